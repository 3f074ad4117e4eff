"""Projections of per-example gradients (DP-GRAPE, Algorithm 1, lines 3-9), applied inside backprop.

A projected weight W (out x in) keeps its larger side: with P of shape (min(out, in) x r),
R_i = P^T G_i (r x in) when out < in ("left"), R_i = G_i P (out x r) otherwise ("right"; square weights
too). Since G_i = sum_t g_t (x) a_t, this is the capture with its output-gradient factor (left) or activation
factor (right) multiplied by P: the engine projects each Linear capture the moment it is made, so neither
the full per-example gradient nor the unprojected factor is kept. The clipped sum of projected per-example
gradients is then one contraction of the projected factors, P^T applied to the book-keeping sum: no
per-example gradient of any kind is materialised (the combination the paper lists as future work).

What is projected (spec P10): stock ``nn.Linear`` weights that the engine's Linear rule handles, owned by
one module only (a weight tied to an embedding is not), whose module name has no component listed in
``exclude`` (the heads by default), and with min(out, in) > r. Embeddings, biases, norms, convolutions and
everything else keep full per-example gradients, full-size noise and full Adam moments (L90, L187).

``RandomProjection``: P has iid N(0, 1/r) entries from a *public* generator seeded by (seed, parameter
name, subspace index), regenerated whenever needed (never stored; one P alive at a time) and refreshed
every ``every`` steps (subspace k = t // every, so the schedule is defined from step 0). E[P P^T] = I.
``SVDProjection``: GaLore (Algorithm 4, on the batch gradient) and naive DP-GaLore (Algorithm 5, on the
*privatized* gradient, post-processing): P from the top-r singular vectors every ``every`` steps, stored
per layer; the statistic is the full gradient.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Iterable

import torch
from torch import nn

from dpopt.grad.captures import Capture, Dense, Outer
from dpopt.grad.engine import PerExampleEngine
from dpopt.grad.rules import RULES, rule_for
from dpopt.noise.rng import public_generator
from dpopt.transforms.base import Transform

EXCLUDE = ("head", "classifier", "lm_head")


def parse_exclude(text: str) -> tuple[str, ...]:
    """``"head,classifier"`` -> ("head", "classifier"): module-name components whose Linear is not projected."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def projectable(model: nn.Module, params: list[torch.Tensor], rank: int, exclude: Iterable[str] = EXCLUDE,
                layers: Iterable[tuple[str, nn.Module]] | None = None) -> dict[int, str]:
    """Index in ``params`` -> side, for every Linear weight worth projecting (see the module docstring).
    ``layers`` restricts the candidates (the engine passes the Linear modules its hooks see)."""
    exclude = set(exclude)
    owners = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    index = {id(p): i for i, p in enumerate(params)}
    if layers is None:
        layers = [(n, m) for n, m in model.named_modules() if rule_for(m) is RULES[nn.Linear]]
    sides = {}
    for name, module in layers:
        w = module.weight
        i = index.get(id(w))
        if i is None or owners[id(w)] > 1 or min(w.shape) <= rank or exclude.intersection(name.split(".")):
            continue
        sides[i] = "left" if w.shape[0] < w.shape[1] else "right"
    return sides


def engine_projectable(engine: PerExampleEngine, rank: int, exclude: Iterable[str] = EXCLUDE) -> dict[int, str]:
    """``projectable`` restricted to the Linear layers whose captures the engine's hooks make."""
    layers = [(u.name, u.module) for u in engine.units if u.rule is RULES[nn.Linear] and "weight" in u.params]
    return projectable(engine.model, engine.params, rank, exclude, layers)


class Projection(Transform):
    """Which weights are projected, on which side, and their current P. A transform to count steps (and,
    for the SVD kind, to refresh P from the gradient it sees)."""

    def __init__(self, params: list[torch.Tensor], names: list[str], sides: dict[int, str], rank: int,
                 every: int) -> None:
        if rank < 1:
            raise ValueError(f"the projection rank must be >= 1, got {rank}")
        if every < 1:
            raise ValueError(f"the subspace must be refreshed every >= 1 steps, got {every}")
        if not sides:
            raise ValueError(f"no trained Linear weight has both sides larger than rank {rank} (heads, tied and "
                             "frozen weights excluded): nothing to project; lower --rank, shorten "
                             "--projection-exclude or train more weights (--trainable)")
        self.params, self.names, self.sides, self.rank, self.every = params, names, sides, rank, every
        self.step = 0

    @property
    def refreshing(self) -> bool:
        """Whether this step starts a new subspace (steps 0, F, 2F, ...)."""
        return self.step % self.every == 0

    def shape(self, i: int) -> torch.Size:
        out_f, in_f = self.params[i].shape
        return torch.Size((self.rank, in_f) if self.sides[i] == "left" else (out_f, self.rank))

    def matrix(self, i: int) -> torch.Tensor:
        raise NotImplementedError

    def project_gradient(self, i: int, g: torch.Tensor) -> torch.Tensor:
        """P^T G (left) or G P (right) for a full gradient G."""
        p = self.matrix(i).to(g.dtype)
        return p.T @ g if self.sides[i] == "left" else g @ p

    def lift(self, i: int, u: torch.Tensor) -> torch.Tensor:
        """Back to the weight's space: P U (left) or U P^T (right)."""
        p = self.matrix(i).to(u.dtype)
        return p @ u if self.sides[i] == "left" else u @ p.T

    def after_update(self, params: list[torch.Tensor]) -> None:
        self.step += 1

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


class RandomProjection(Projection):
    """DP-GRAPE's public Gaussian projections, applied to the statistic by the engine."""

    def __init__(self, params: list[torch.Tensor], names: list[str], sides: dict[int, str], rank: int, every: int,
                 seed: int) -> None:
        super().__init__(params, names, sides, rank, every)
        self.seed = seed

    @classmethod
    def on(cls, engine: PerExampleEngine, rank: int, every: int, seed: int,
           exclude: Iterable[str] = EXCLUDE) -> "RandomProjection":
        """The projection of every projectable Linear weight of ``engine``'s model."""
        return cls(engine.params, engine.names, engine_projectable(engine, rank, exclude), rank, every, seed)

    def matrix(self, i: int) -> torch.Tensor:
        """Regenerated bit-identically from (seed, name, subspace), float32, by a generator on the weight's device
        (P5; no host copy per layer: a CUDA run draws other, equally public, matrices than a CPU run)."""
        p = self.params[i]
        g = public_generator(self.seed, "grape", self.names[i], self.step // self.every, device=p.device)
        return torch.randn(min(p.shape), self.rank, generator=g, device=p.device) / math.sqrt(self.rank)

    def project(self, i: int, capture: Capture) -> Capture:
        """The capture of R_i = P^T G_i or G_i P: the matching factor times P."""
        p = self.matrix(i)
        left = self.sides[i] == "left"
        shape = self.shape(i)
        if isinstance(capture, Outer) and not capture.indexed:
            if left:
                return Outer(capture.left @ p.to(capture.left.dtype), capture.right, self.rank, shape)
            return Outer(capture.left, capture.right @ p.to(capture.right.dtype), capture.rows, shape)
        g = capture.materialize().reshape(capture.batch_size, *self.params[i].shape)
        p = p.to(g.dtype)
        return Dense(torch.einsum("bmn,mr->brn", g, p) if left else g @ p, shape)


class SVDProjection(Projection):
    """GaLore's projection: every ``every`` steps P = the top-r singular vectors (on the projected side) of
    the gradient this transform sees; stored per layer. Given the privatized gradient (naive DP-GaLore) it
    is free post-processing of the release."""

    def __init__(self, params: list[torch.Tensor], names: list[str], sides: dict[int, str], rank: int,
                 every: int) -> None:
        super().__init__(params, names, sides, rank, every)
        self.matrices: dict[int, torch.Tensor] = {}

    @classmethod
    def on(cls, engine: PerExampleEngine, rank: int, every: int, exclude: Iterable[str] = EXCLUDE) -> "SVDProjection":
        return cls(engine.params, engine.names, engine_projectable(engine, rank, exclude), rank, every)

    def matrix(self, i: int) -> torch.Tensor:
        return self.matrices[i]

    def __call__(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.refreshing:
            for i, side in self.sides.items():
                u, _, vh = torch.linalg.svd(grads[i].float(), full_matrices=False)
                self.matrices[i] = (u[:, :self.rank] if side == "left" else vh[:self.rank].T).contiguous()
        return grads

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "matrices": self.matrices}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.matrices = state["step"], state["matrices"]
