"""Audit setups for the families that exist: where the canaries go and what is observed.

* ``DiracRows`` (first-order recipes and DiSK): the model is an ``Embedding(K, 1)`` and canary c is the
  example whose loss is M * w_c, so its per-example gradient is M e_c: a Dirac in a row no other example
  touches. The loss is linear, so the gradient is the same at every point DiSK evaluates it. The dataset
  holds all K slots and an absent canary's slot is zeroed out (loss 0): under Poisson sampling with the
  normaliser fixed this is the add/remove neighbour, and every canary keeps its position, which samplers
  with a public order (fixed-order batches) need. Observed: row c of every step's release.
* ``ProjectedDirac`` (DP-GRAPE, DP-GaLore, DiSK on DP-GRAPE): the model is a ``Linear(K / r, 2r)`` (the GRAPE projection
  keeps the input side, rank r) and canary (j, i) is the example with input e_i and loss M <u_j, W e_i>.
  Under DP-GRAPE u_j = P (P^T P)^{-1} e_j for the public projection P, so the projected per-example
  gradient P^T G = M e_j e_i^T is a Dirac in the r x (K / r) projected statistic; under DP-GaLore (full
  statistic) u_j = e_j. Observed: entry (j, i) of every step's release.

Both score a canary by the likelihood ratio of its T observations (``poisson_gaussian_llr``) under the
run's claimed sampling rate and noise multiplier. With flat clipping every canary's clipped statistic is
exactly C times its direction whatever the recipe does before clipping, so recipes that share stages 1, 3
and 4 release identical canary observations under the same seeds (the first-order recipes and DiSK;
DP-GRAPE and DP-GaLore): their audits differ only where their privatization differs.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dpopt.algorithms import Privatizer, build_algorithm
from dpopt.audit.auditor import (AuditSpec, Observation, poisson_gaussian_llr, poisson_privatizer, record_releases,
                                 register_audit)
from dpopt.device import resolve_device
from dpopt.grad.batch import LossFn
from dpopt.grad.engine import PerExampleEngine


class GaussianCanaries:
    """Dirac canaries in a recipe that releases a Poisson-sampled, Gaussian-noised sum: the observations
    x [K, T] of canary k are, in units of the clip bound, b_t + z xi_t when it is in (b_t ~ Bernoulli(q))
    and z xi_t when it is out. A family with another sampler or noise overrides ``privatizer`` and ``score``.
    """

    def privatizer(self, algorithm: str, spec: AuditSpec, dataset_size: int) -> Privatizer:
        return poisson_privatizer(spec, dataset_size)

    def score(self, x: torch.Tensor, privatizer: Privatizer) -> torch.Tensor:
        """The likelihood ratio of the observations under the run's claimed sampling rate and noise."""
        return poisson_gaussian_llr(x, privatizer.sampler.participation.rate, privatizer.noise.noise_multiplier)

    def observations(self, algorithm: str, spec: AuditSpec, present: torch.Tensor) -> tuple[torch.Tensor, Privatizer]:
        raise NotImplementedError

    def observe(self, algorithm: str, spec: AuditSpec, present: torch.Tensor) -> Observation:
        x, privatizer = self.observations(algorithm, spec, present)
        return Observation(self.score(x, privatizer).cpu(), privatizer.ledger)

    def run_recipe(self, algorithm: str, spec: AuditSpec, model: nn.Module, loss: LossFn, ids: torch.Tensor,
                   configure: Callable[[PerExampleEngine], None] | None = None,
                   **settings: object) -> tuple[torch.Tensor, Privatizer]:
        """Build the recipe on ``model`` with the canaries ``ids`` as its dataset, run ``spec.steps`` steps
        and return the releases of the (only) parameter, stacked on a last step dimension, in units of the
        clip bound; ``configure`` sees the engine after the recipe was built (a projection, say); ``settings``
        are the recipe's hyper-parameters beside ``spec.lr``."""
        engine = PerExampleEngine(model, loss)
        privatizer = self.privatizer(algorithm, spec, len(ids))
        optimizer = build_algorithm(algorithm, engine, privatizer, spec.hyperparameters(algorithm, **settings))
        if configure is not None:
            configure(engine)
        recorder = record_releases(optimizer, 0)
        for _ in range(spec.steps):
            optimizer.step(ids)
        releases = torch.stack(recorder.releases, -1) * (privatizer.sampler.normalizer / spec.clip)
        return releases, privatizer


class DiracRows(GaussianCanaries):
    default_canaries = 1_000_000

    def observations(self, algorithm: str, spec: AuditSpec, present: torch.Tensor) -> tuple[torch.Tensor, Privatizer]:
        k, device = len(present), resolve_device(spec.device)
        model = nn.Embedding(k, 1, device=device)
        nn.init.zeros_(model.weight)
        scale = present.to(device).float() * (spec.canary_norm * spec.clip)  # an absent canary's slot is zeroed out

        def loss(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
            return scale[ids] * m(ids).squeeze(-1)

        releases, privatizer = self.run_recipe(algorithm, spec, model, loss, torch.arange(k))
        return releases.reshape(k, spec.steps), privatizer


class ProjectedDirac(GaussianCanaries):
    default_canaries = 65_536

    def __init__(self, rank: int = 64) -> None:
        self.rank = rank

    def observations(self, algorithm: str, spec: AuditSpec, present: torch.Tensor) -> tuple[torch.Tensor, Privatizer]:
        k, r = len(present), self.rank
        inputs = math.ceil(k / r)
        device = resolve_device(spec.device)
        model = nn.Linear(inputs, 2 * r, bias=False, device=device)
        nn.init.zeros_(model.weight)
        scale = spec.canary_norm * spec.clip
        c = torch.arange(k, device=device)
        row, col = c // inputs, c % inputs  # canary c sits at (j, i) = (row, col)
        directions = torch.eye(2 * r, device=device)[:, :r]  # u_j as columns; P (P^T P)^{-1} under a projection

        def loss(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
            out = m(F.one_hot(col[ids], inputs).float())
            return scale * (out * directions.T[row[ids]]).sum(-1)

        def configure(engine: PerExampleEngine) -> None:
            nonlocal directions
            projection = engine.projection
            if projection is not None and 0 in projection.sides:
                if projection.sides[0] != "left":
                    raise AssertionError("the canary layer must be projected on its output side")
                p = projection.matrix(0).double()
                directions = (p @ torch.linalg.inv(p.T @ p)).float()

        # The subspace must not change during the audit, so that the directions stay valid.
        releases, privatizer = self.run_recipe(algorithm, spec, model, loss, present.nonzero().squeeze(1),
                                                  configure, rank=r, subspace_every=spec.steps)
        return releases[row, col], privatizer


register_audit(DiracRows(), "dp-sgd", "dp-adam", "dp-adamw", "disk-sgd", "disk-adam", "disk-adamw")
register_audit(ProjectedDirac(), "dp-grape", "dp-galore", "disk-grape")
