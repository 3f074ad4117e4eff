"""Audit setup for recipes that release one scalar per step (DPZero, DPGD-0th): one canary per run."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from dpopt.algorithms import Privatizer, build_algorithm
from dpopt.audit.auditor import AuditSpec, register_audit
from dpopt.audit.canaries import GaussianCanaries
from dpopt.grad.engine import PerExampleEngine
from dpopt.noise.rng import derive_seed


class ScalarRuns(GaussianCanaries):
    """K runs of ``spec.steps`` steps, each with its own secret seed, of a one-parameter model whose only
    example is the canary (loss M w) or its zeroed-out slot. The direction law is the sphere of radius
    sqrt(d) = 1, so u_t = +-1 and the canary's scalar M u_t is always clipped to +-C. Observed: the
    parameter change, -dw_t / lr = g_t u_t (DPZero) or g_t (DPGD-0th), in units of C / normaliser:
    b_t + z xi_t either way."""

    default_canaries = 20_000

    def observations(self, algorithm: str, spec: AuditSpec, present: torch.Tensor) -> tuple[torch.Tensor, Privatizer]:
        hp = spec.hyperparameters(algorithm, direction="sphere")
        x = torch.empty(len(present), spec.steps, dtype=torch.float64)
        one = torch.zeros(1, dtype=torch.long)
        for k, here in enumerate(present.tolist()):
            secret = None if spec.secret_seed is None else derive_seed(spec.secret_seed, "audit run", k)
            run = dataclasses.replace(spec, secret_seed=secret)
            model = nn.Embedding(1, 1)
            nn.init.zeros_(model.weight)
            scale = float(here) * spec.canary_norm * spec.clip
            engine = PerExampleEngine(model, lambda m, ids, scale=scale: scale * m(ids).squeeze(-1))
            privatizer = self.privatizer(algorithm, run, 1)
            optimizer = build_algorithm(algorithm, engine, privatizer, hp)
            for t in range(spec.steps):
                before = float(model.weight.detach())
                optimizer.step(one)
                x[k, t] = (before - float(model.weight.detach())) / hp.lr
            x[k] *= privatizer.sampler.normalizer / spec.clip
        return x, privatizer


register_audit(ScalarRuns(), "dpzero", "dpgd-0th")
