"""Audit setup for federated local DP (Clip-SGD, Clip21-SGD, Clip21-SGD2M): every client is one canary.

The threat model of local DP is a server that sees every message. Client i's data is the canary: its
gradient is +M·τ·u when present and −M·τ·u when replaced (the ledger's replace-one neighbours), M =
``canary_norm`` so every clip binds. A client is scored by Σ_t ⟨c_i^t, u⟩ over the messages it sent.
Clients draw noise from their own secret streams and see only their own data, so the K clients are
independent trials, as the Dirac rows of ``canaries.py`` are.
"""

from __future__ import annotations

import math

import torch

from dpopt.audit.auditor import AuditSpec, Observation, register_audit
from dpopt.federated.config import FederatedConfig, build_setup
from dpopt.federated.problem import Problem
from dpopt.federated.simulator import InProcessFederation


class LocalDPClients:
    """K clients of a two-parameter problem, ``spec.steps`` rounds, noise calibrated to the spec's budget."""

    default_canaries = 2000

    def observe(self, algorithm: str, spec: AuditSpec, present: torch.Tensor) -> Observation:
        k = len(present)
        u = torch.ones(2, dtype=torch.float64) / math.sqrt(2)  # parallel to itself under global or per-layer clips
        sign = torch.where(present, spec.canary_norm * spec.clip, -spec.canary_norm * spec.clip).double()
        problem = Problem(lambda x, who, t: sign[who].unsqueeze(1) * u, torch.zeros(2, dtype=torch.float64),
                          [1, 1], [1] * k, lambda x: {})
        config = FederatedConfig(algorithm=algorithm, clients=k, rounds=spec.steps, epsilon=spec.epsilon,
                                 delta=spec.delta, clip=spec.clip, lr=spec.lr, seed=spec.seed,
                                 eval_every=spec.steps + 1)
        federation = InProcessFederation(build_setup(config, problem, key=spec.secret_seed))
        sent: list[torch.Tensor] = []
        add_noise = federation.noise.add_to

        def seen_by_the_server(rows: torch.Tensor, who: torch.Tensor, t: int) -> torch.Tensor:
            sent.append(add_noise(rows, who, t))
            return sent[-1]

        federation.noise.add_to = seen_by_the_server
        for _ in range(spec.steps):
            federation.step()
        return Observation((torch.stack(sent) @ u).sum(0), federation.ledgers.ledgers[0])


register_audit(LocalDPClients(), "clip-sgd", "clip21-sgd", "clip21-sgd2m")
