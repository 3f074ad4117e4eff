"""An empirical audit of the federated local-DP mechanism: a lower bound on each client's epsilon from what
the server sees, checked against the client's ledger (sound) and shown to catch a client that adds too
little noise (not vacuous).

Each of K clients is one trial of the hypothesis test "dataset D_in vs D_out", the replace-one neighbours of
the ledger (a client's whole dataset replaced): a client's gradient is +G·u in D_in and −G·u in D_out
(G far above τ, so clipping binds). The adversary sees every message c_i^t the client sends (the local-DP
threat model) and scores the client by Σ_t ⟨c_i^t, u⟩. Clients draw their noise from their own secret
streams and their gradients depend only on their own data, so the K trials are independent; a threshold
picked on a random calibration part is evaluated on the rest, with one-sided Clopper-Pearson bounds on
FPR and FNR (each at level α/2) turned into epsilon by the hypothesis-testing view of DP (Kairouz, Oh,
Viswanath 2015, Thm 2.1; Jagielski, Ullman, Oprea 2020, Sec. 3), as in `dpopt.audit.bounds`.
"""

import math

import pytest
import torch

from dpopt.audit import bounds
from dpopt.federated.config import FederatedConfig, build_setup
from dpopt.federated.privacy import ClientNoise, LocalNoise
from dpopt.federated.problem import Problem
from dpopt.federated.simulator import InProcessFederation

DELTA, CONFIDENCE = 1e-5, 0.95


def epsilon_lower_bound(scores: torch.Tensor, present: torch.Tensor, calibration: float = 0.2) -> float:
    """Epsilon lower bound with confidence CONFIDENCE from a threshold test ("in" if score >= t)."""
    calib = torch.rand(len(scores), generator=torch.Generator().manual_seed(0)) < calibration

    def bound(part: torch.Tensor, t: float) -> float:
        s, p = scores[part], present[part]
        fp, fn = int((s[~p] >= t).sum()), int((s[p] < t).sum())
        return float(bounds.epsilon_lower_bound(fp, int((~p).sum()), fn, int(p.sum()), DELTA, CONFIDENCE))

    candidates = torch.quantile(scores[calib], torch.linspace(0.01, 0.99, 99, dtype=scores.dtype)).tolist()
    threshold = max(candidates, key=lambda t: bound(calib, t))
    return bound(~calib, threshold)


def audit(algorithm: str, clipping: str, noise_scale: float, clients: int = 2000, rounds: int = 4) -> tuple[float, float]:
    """(epsilon claimed by a client's ledger, epsilon lower bound) for a run whose clients add
    ``noise_scale`` times the noise their ledgers record."""
    present = torch.rand(clients, generator=torch.Generator().manual_seed(1)) < 0.5
    u = torch.tensor([1.0, 1.0], dtype=torch.float64) / math.sqrt(2)  # clipped globally or per coordinate: ∥ u
    sign = torch.where(present, 10.0, -10.0).double()  # G = 10 τ: every clip binds
    problem = Problem(lambda x, who, t: sign[who].unsqueeze(1) * u, torch.zeros(2, dtype=torch.float64), [1, 1],
                      [1] * clients, lambda x: {})
    config = FederatedConfig(algorithm=algorithm, clients=clients, rounds=rounds, noise_multiplier=8.0, clip=1.0,
                             lr=0.1, clipping=clipping, seed=3, eval_every=100)
    setup = build_setup(config, problem, key=3)  # secret seed 3: a fixed outcome, so the test never flakes
    fed = InProcessFederation(setup)
    if noise_scale != 1.0:  # a broken client: less noise than the ledger records
        fed.noise = ClientNoise(LocalNoise(noise_scale * setup.noise.std, setup.noise.sensitivity), clients,
                                setup.secret_key)
    sent: list[torch.Tensor] = []
    add_noise = fed.noise.add_to
    fed.noise.add_to = lambda rows, who, t: sent.append(add_noise(rows, who, t)) or sent[-1]  # the server's view
    for _ in range(rounds):
        fed.step()
    assert all(len(rows) == clients for rows in sent)
    scores = (torch.stack(sent) @ u).sum(0)
    claimed = fed.ledgers.epsilons(DELTA)
    assert len(set(claimed)) == 1
    return claimed[0], epsilon_lower_bound(scores, present)


@pytest.mark.parametrize("algorithm,clipping", [("clip-sgd", "flat"), ("clip21-sgd", "flat"),
                                                ("clip21-sgd2m", "flat"), ("clip21-sgd2m", "per-layer")])
def test_audit_lower_bound_respects_the_ledger_and_catches_missing_noise(algorithm, clipping):
    claimed, lower = audit(algorithm, clipping, noise_scale=1.0)
    # Sound. How far below the claim a correct run's bound lies depends on the noise drawn (secret seeds 0-39,
    # claim 1.99: clip-sgd 0.08-0.75; clip21-sgd2m layerwise under 0.2 in 37 of 40), so the power shows below.
    assert 0 <= lower <= claimed
    claimed_broken, lower_broken = audit(algorithm, clipping, noise_scale=0.1)
    assert claimed_broken == claimed and lower_broken > claimed  # a tenth of the noise is a violation
