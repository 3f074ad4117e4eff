"""Audit setup for recipes with correlated noise and fixed-order batches (DP-FTRL, DP-MEMF, DP-SRG-MEMF,
Accelerated-DP-SRGD, DP-SRGD): the Dirac rows of ``DiracRows``, every canary in its fixed slot."""

from __future__ import annotations

import copy

import torch

from dpopt.algorithms import Privatizer
from dpopt.audit.auditor import AuditSpec, register_audit
from dpopt.audit.canaries import DiracRows
from dpopt.clipping import Clipping
from dpopt.data.samplers import FixedOrderSampler
from dpopt.noise.rng import SecretStream, secret_key
from dpopt.privacy import PrivacyLedger
from dpopt.train import TrainConfig, build_run_noise

COVARIANCE_DRAWS = 200_000


class CorrelatedRows(DiracRows):
    """A canary's observations are x = a + z s n, with a its public participation pattern and n the
    mechanism's noise, correlated across steps with covariance S. They are scored by the Gaussian likelihood
    ratio a^T S^-1 (x - a / 2). S is measured on the mechanism itself, with a stream of its own."""

    def privatizer(self, algorithm: str, spec: AuditSpec, dataset_size: int) -> Privatizer:
        batch = max(1, round(spec.sample_rate * dataset_size))
        key = secret_key(spec.secret_seed)
        sampler = FixedOrderSampler(dataset_size, batch, SecretStream(key, "sampling"))
        config = TrainConfig(algorithm=algorithm, epsilon=spec.epsilon, delta=spec.delta, clip=spec.clip, hp=spec.hp,
                             sampling="fixed")
        clipping = Clipping(spec.clip)
        noise = build_run_noise(config, sampler, spec.steps, clipping.sensitivity, SecretStream(key, "noise"),
                                log=lambda _: None)
        return Privatizer(clipping, noise, sampler, PrivacyLedger())

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


register_audit(CorrelatedRows(), "dp-ftrl", "dp-memf", "dp-srg-memf", "accel-dp-srgd", "dp-srgd")
