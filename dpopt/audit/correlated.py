"""Audit setups for recipes with correlated noise: the Dirac rows of ``DiracRows``, every canary in its slot.

* ``CorrelatedRows`` — fixed-order batches (DP-FTRL, DP-SRG-MEMF, Accelerated-DP-SRGD, DP-SRGD).
* ``AmplifiedBandedRows`` — amplified BandMF, dp-memf's default: cyclic Poisson sampling, banded noise.
"""

from __future__ import annotations

import copy

import torch

from dpopt.algorithms import Privatizer
from dpopt.audit.auditor import AuditSpec, poisson_gaussian_llr, register_audit
from dpopt.audit.canaries import DiracRows
from dpopt.noise.rng import SecretStream, secret_key
from dpopt.plan import PrivacyPlan

COVARIANCE_DRAWS = 200_000


class CorrelatedRows(DiracRows):
    """A canary's observations are x = a + z s n, with a its public participation pattern and n the
    mechanism's noise, correlated across steps with covariance S. They are scored by the Gaussian likelihood
    ratio a^T S^-1 (x - a / 2). S is measured on the mechanism itself, with a stream of its own."""

    def privatizer(self, algorithm: str, spec: AuditSpec, dataset_size: int) -> Privatizer:
        batch = max(1, round(spec.sample_rate * dataset_size))
        plan = PrivacyPlan(algorithm, dataset_size, batch, steps=spec.steps, epsilon=spec.epsilon, delta=spec.delta,
                           clip=spec.clip, sampling="fixed",
                           hyperparameters=spec.hyperparameters(algorithm))
        return plan.make(secret_key(spec.secret_seed), log=lambda _: None)

    def score(self, x: torch.Tensor, privatizer: Privatizer) -> torch.Tensor:
        k, steps = x.shape
        a = torch.zeros(k, steps, dtype=torch.float64)
        for t in range(steps):
            a[privatizer.sampler.batch(t), t] = 1.0
        noise = privatizer.noise
        probe = copy.copy(noise.calibrated(1.0))
        probe.stream = SecretStream(0, "audit covariance")
        n = torch.stack([probe.unit_noise(t, [torch.Size([COVARIANCE_DRAWS])])[0] for t in range(steps)]).double()
        cov = (n @ n.T / COVARIANCE_DRAWS) * (noise.std / noise.sensitivity) ** 2
        w = torch.linalg.solve(cov, a.T).T
        return (w * (x.double() - a / 2)).sum(1)


class AmplifiedBandedRows(DiracRows):
    """Canary k is in group k mod p of cyclic Poisson sampling (period p, banded noise with p bands): it may
    join steps t = k mod p, k mod p + p, ... at rate q. Its observations x = a + z C⁻¹ζ are whitened by C,
    C x = C a + z ζ, and projected on its group's columns, which touch disjoint rows and have unit norm:
    s_j = b_j + z ξ_j with b_j ~ Bernoulli(q), independent. So the canary is scored by the Poisson-Gaussian
    likelihood ratio of its visits, under exactly the model the ledger claims (Choquette-Choo et al. 2023)."""

    period = 2

    def privatizer(self, algorithm: str, spec: AuditSpec, dataset_size: int) -> Privatizer:
        batch = max(1, round(spec.sample_rate * dataset_size / self.period))  # rate: spec.sample_rate
        plan = PrivacyPlan(algorithm, dataset_size, batch, steps=spec.steps, epsilon=spec.epsilon, delta=spec.delta,
                           clip=spec.clip, sampling="cyclic", bands=self.period,
                           hyperparameters=spec.hyperparameters(algorithm))
        return plan.make(secret_key(spec.secret_seed), log=lambda _: None)

    def score(self, x: torch.Tensor, privatizer: Privatizer) -> torch.Tensor:
        c = privatizer.noise.matrix()
        whitened = x.double() @ c.T  # row k: C x_k
        scores = torch.empty(x.shape[0], dtype=torch.float64)
        for group in range(self.period):
            visits = whitened[group::self.period] @ c[:, group::self.period]  # <C[:, t], C x_k> per visit t
            scores[group::self.period] = poisson_gaussian_llr(visits, privatizer.sampler.participation.rate,
                                                              privatizer.noise.noise_multiplier)
        return scores


register_audit(CorrelatedRows(), "dp-ftrl", "dp-srg-memf", "accel-dp-srgd", "dp-srgd")
register_audit(AmplifiedBandedRows(), "dp-memf")
