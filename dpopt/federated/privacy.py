"""Local DP for the clients' messages: the noise ω_i, its calibration, and one ledger per client.

A message is c_i = δ_i + ω_i with ‖δ_i‖ ≤ s (s = τ globally, τ√K layer-wise) whatever the client's data,
so any two of a client's messages differ by at most 2s: each round is a Gaussian mechanism of
sensitivity 2s under the replace-one relation, and this holds for one example or for the client's whole
dataset (spec §2: local and client-level DP). The core ledger expresses exactly that as a
``GaussianRelease`` with noise multiplier σ_ω/s under ``Relation.REPLACE_ONE``. A client's epsilon
composes the rounds in which it *released* a message, whether or not the server used it. No
amplification by client or mini-batch sampling is claimed (the paper claims none).

A client's releases are all plain Gaussian mechanisms, whose k-fold composition is exactly one Gaussian
mechanism with μ = sqrt(Σ_j (2s/σ_j)²) (Dong, Roth & Su, 2019), so its epsilon is computed exactly from
δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (Balle & Wang, 2018): instant at any ε, where the PLD accountant
needs seconds at large ε (the paper's noise-to-clip ratios of 0.1-10 give ε of 10-10^5) and agrees with
it up to its discretisation (tested).

Two calibrations for a target (ε, δ) over T rounds:
* ``pld`` (default): the smallest σ_ω whose T-fold composition the core's PLD calibration certifies.
* ``paper``: Corollary 1's closed form σ_ω = (8s/ε)·sqrt(T·ln(5T/(4δ))·ln(1/δ)) (proof L1992-1996: Gaussian
  mechanism per round, then advanced composition, Dwork & Roth Cor. 3.21, which needs ε < 1 and in fact
  certifies (ε, 2δ): T·δ/T + δ). The ledger still reports its own, much smaller, epsilon at δ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from scipy.optimize import brentq
from scipy.special import log_ndtr

from dpopt.noise.rng import SecretStream
from dpopt.privacy import (FixedParticipation, GaussianRelease, PrivacyLedger, Relation, check_budget,
                           noise_multiplier_for)

CALIBRATIONS = ("accountant", "advanced-composition")  # the PLD accountant, or the paper's closed form
RENAMED_CALIBRATIONS = {"pld": "accountant", "paper": "advanced-composition"}
EVERY_ROUND = FixedParticipation(1)


def paper_noise_std(sensitivity: float, rounds: int, epsilon: float, delta: float) -> float:
    """Corollary 1 (proof, L1992): σ_ω = (8s/ε)·sqrt(T·ln(5T/(4δ))·ln(1/δ)); needs ε, δ ∈ (0, 1)."""
    check_budget(epsilon, delta)
    if epsilon >= 1.0:
        raise ValueError(f"the paper's closed-form noise (Corollary 1, via advanced composition) is proven for "
                         f"epsilon < 1, got {epsilon}; use --calibration accountant")
    return 8.0 * sensitivity / epsilon * math.sqrt(rounds * math.log(5 * rounds / (4 * delta)) * math.log(1 / delta))


def check_calibration(calibration: str) -> None:
    if calibration in RENAMED_CALIBRATIONS:
        raise ValueError(f"calibration {calibration!r} is now {RENAMED_CALIBRATIONS[calibration]!r}")
    if calibration not in CALIBRATIONS:
        raise ValueError(f"unknown calibration {calibration!r}; choose one of {', '.join(CALIBRATIONS)}")


def noise_std_for(sensitivity: float, rounds: int, epsilon: float, delta: float,
                  calibration: str = "accountant") -> float:
    """σ_ω that makes a client releasing in all ``rounds`` rounds (ε, δ)-DP."""
    check_calibration(calibration)
    if calibration == "advanced-composition":
        return paper_noise_std(sensitivity, rounds, epsilon, delta)
    z = noise_multiplier_for(epsilon, delta, EVERY_ROUND, rounds, "pld", Relation.REPLACE_ONE)
    return z * sensitivity


@dataclass(frozen=True)
class LocalNoise:
    """ω_i ~ N(0, std² I) on every message whose norm is at most ``sensitivity`` before noise."""

    std: float
    sensitivity: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.std) and self.std >= 0):
            raise ValueError(f"the noise std must be a finite number >= 0, got {self.std}")

    @property
    def noise_multiplier(self) -> float:
        return self.std / self.sensitivity

    def release(self) -> GaussianRelease:
        """What one message releases, for the client's ledger."""
        return GaussianRelease(self.noise_multiplier, EVERY_ROUND)


def client_stream(key: int | bytes | None, client: int, purpose: str) -> SecretStream:
    """The secret stream of one client for one purpose (``noise``, ``batch``, ``gradient-noise``),
    indexed by round; the same draws whichever engine runs the client."""
    return SecretStream(key, f"federated/client/{client}/{purpose}")


class ClientNoise:
    """Draws ω_i for any subset of clients from each client's own secret stream."""

    def __init__(self, noise: LocalNoise, clients: int, key: int | bytes | None) -> None:
        self.noise = noise
        self.streams = [client_stream(key, i, "noise") for i in range(clients)]

    def add_to(self, messages: torch.Tensor, clients: list[int], round: int) -> torch.Tensor:
        """Adds ω to each row of ``messages`` [k, d] (row j belongs to ``clients[j]``), in place."""
        if self.noise.std == 0.0:
            return messages
        for row, i in zip(messages, clients):
            row.add_(self.streams[i].normals([row.shape], round, row.device)[0], alpha=self.noise.std)
        return messages


def gaussian_epsilon(mu: float, delta: float) -> float:
    """The exact epsilon at ``delta`` of a Gaussian mechanism with sensitivity/std ratio ``mu``."""
    if mu == 0.0:
        return 0.0
    if math.isinf(mu):
        return math.inf

    def excess(eps: float) -> float:  # delta(eps) - delta, decreasing in eps; e^eps Phi(.) in log space
        return math.exp(log_ndtr(-eps / mu + mu / 2)) - math.exp(eps + log_ndtr(-eps / mu - mu / 2)) - delta

    if excess(0.0) <= 0:
        return 0.0
    hi = mu * mu / 2 + mu * math.sqrt(2 * math.log(1 / delta)) + 1.0
    while excess(hi) > 0:
        hi *= 2
    return float(brentq(excess, 0.0, hi, xtol=1e-12, rtol=1e-12))


def ledger_epsilon(ledger: PrivacyLedger, delta: float) -> float:
    """Exact epsilon of a client's ledger of plain (non-subsampled) Gaussian releases under replace-one."""
    if ledger.relation != Relation.REPLACE_ONE or not all(
            isinstance(e, GaussianRelease) and e.participation == EVERY_ROUND for e in ledger.entries):
        return ledger.epsilon(delta)
    if any(e.noise_multiplier == 0.0 and e.steps for e in ledger.entries):
        return math.inf
    return gaussian_epsilon(math.sqrt(sum(e.steps * (2.0 / e.noise_multiplier) ** 2 for e in ledger.entries)), delta)


def epsilons_of(ledgers: list[PrivacyLedger], delta: float) -> list[float]:
    """Each ledger's epsilon at ``delta``; equal ledgers share one computation."""
    cache: dict[tuple, float] = {}
    out = []
    for ledger in ledgers:
        key = tuple(ledger.entries)
        if key not in cache:
            cache[key] = ledger_epsilon(ledger, delta)
        out.append(cache[key])
    return out


def client_ledger() -> PrivacyLedger:
    """A client's ledger: replace-one neighbours (an example or the client's whole dataset), PLD."""
    return PrivacyLedger(Relation.REPLACE_ONE, "pld")


class ClientLedgers:
    """One core ``PrivacyLedger`` per client, each recording the messages that client released.

    A round's releases are counted and written to the ledgers (as one entry of ``steps`` releases, which
    is how the core ledger merges repeats) whenever they are read or the mechanism changes, so recording
    costs O(1) per round for any number of clients."""

    def __init__(self, clients: int) -> None:
        self._ledgers = [client_ledger() for _ in range(clients)]
        self._pending = torch.zeros(clients, dtype=torch.long)
        self._release: GaussianRelease | None = None

    def record(self, clients: list[int], release: GaussianRelease) -> None:
        """Each listed client released one message of this kind."""
        if release != self._release:
            self._flush()
            self._release = release
        self._pending[torch.tensor(clients, dtype=torch.long)] += 1

    def _flush(self) -> None:
        if self._release is not None:
            for i in self._pending.nonzero().flatten().tolist():
                self._ledgers[i].record(replace(self._release, steps=int(self._pending[i])))
        self._pending.zero_()

    @property
    def ledgers(self) -> list[PrivacyLedger]:
        self._flush()
        return self._ledgers

    def releases(self) -> list[int]:
        return [ledger.steps for ledger in self.ledgers]

    def epsilons(self, delta: float) -> list[float]:
        return epsilons_of(self.ledgers, delta)

    def to_dict(self) -> list[dict]:
        return [ledger.to_dict() for ledger in self.ledgers]
