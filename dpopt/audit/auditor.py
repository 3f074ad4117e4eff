"""Empirical privacy auditing: a lower bound on a run's epsilon, with a stated confidence, from canaries.

One audit is one small private run of the library's own recipe (sampler, per-example statistic,
``Privatizer`` and ledger, transforms, base update) on a dataset of *canaries*: examples whose per-example
statistic is a known direction of norm far above the clip bound, each in its own coordinate ("Dirac"
gradient canaries, Nasr et al. 2021, "Adversary instantiation", Sec. 4; Nasr et al. 2023, "Tight
auditing of differentially private machine learning"). Half of the canaries, chosen at random, are put in
the dataset; the auditor observes what the run releases, scores every canary, and runs the threshold test
of ``bounds.py`` on the scores.

Many canaries in one run, as in one-run auditing (Steinke, Nasr, Jagielski 2023, "Privacy auditing with
one (1) training run"), but here each canary owns coordinates no other example touches, the noise is
independent per coordinate and Poisson sampling is independent per example: the canaries' observations are
independent, so they are independent trials of one hypothesis test and the two-sample Clopper-Pearson
bound applies directly (not the weaker one-run bound). The threat model is the accountant's: every step's
release (the privatized statistic, before post-processing) is observed.

Families register an ``AuditSetup`` for their algorithm names (``register_audit``): how to build the tiny
model and mechanism, where the canaries go, what is observed and how a canary is scored. The epsilon
claimed is the run's own ledger's at the audit's delta.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from dpopt.algorithms import ALGORITHMS, PrivateStep, Hyperparameters, Privatizer, hyperparameters_for
from dpopt.audit.bounds import ThresholdTest, threshold_audit
from dpopt.clipping import Clipping
from dpopt.data.samplers import PoissonSampler
from dpopt.device import resolve_device
from dpopt.noise.gaussian import GaussianNoise
from dpopt.noise.rng import SecretStream, derive_seed, secret_key
from dpopt.privacy import PrivacyLedger, check_budget, noise_multiplier_for
from dpopt.transforms.base import Transform


@dataclass(frozen=True)
class AuditSpec:
    """The run under audit and the test's settings. The run's noise is calibrated to (epsilon, delta)
    over ``steps`` Poisson-sampled steps at ``sample_rate``, as ``dpopt train`` calibrates it."""

    epsilon: float = 2.0
    delta: float = 1e-5
    steps: int = 4
    sample_rate: float = 0.5
    canaries: int | None = None  # None: the setup's default
    confidence: float = 0.95
    calibration: float = 0.2  # fraction of the canaries that only choose the threshold
    clip: float = 1.0
    canary_norm: float = 10.0  # each canary's statistic has norm canary_norm * clip before clipping
    seed: int = 0  # the auditor's canary draw (public to the auditor)
    secret_seed: int | None = None  # the audited runs' secret streams: replayable; None: OS-entropy keys
    device: str = "cpu"  # where the model-based setups (first-order recipes) run
    lr: float = 0.01  # the audited recipe's learning rate; its other hyper-parameters are its defaults

    def __post_init__(self) -> None:
        check_budget(self.epsilon, self.delta)
        if self.steps < 1:
            raise ValueError(f"the audited run needs steps >= 1, got {self.steps}")
        if not 0.0 < self.sample_rate <= 1.0:
            raise ValueError(f"the sampling rate must lie in (0, 1], got {self.sample_rate}")
        if self.canaries is not None and self.canaries < 100:
            raise ValueError(f"an audit needs at least 100 canaries (it bounds error rates), got {self.canaries}")
        if not 0.0 < self.confidence < 1.0:
            raise ValueError(f"the confidence must lie in (0, 1), got {self.confidence}")
        if not 0.0 < self.calibration < 1.0:
            raise ValueError(f"the calibration fraction must lie in (0, 1), got {self.calibration}")
        if not self.canary_norm >= 1.0:
            raise ValueError(f"canaries must reach the clip bound (canary_norm >= 1), got {self.canary_norm}")
        resolve_device(self.device)

    def hyperparameters(self, algorithm: str, **settings: object) -> Hyperparameters:
        """The audited recipe's hyper-parameters: its defaults at ``lr`` over the run's steps, with ``settings`` on
        top."""
        return hyperparameters_for(algorithm, lr=self.lr, **settings).for_run(self.steps)


@dataclass(frozen=True)
class Observation:
    """What a setup hands back: one score per canary (higher: more likely in the dataset) and the ledger
    of the run, whose epsilon is the claim under audit."""

    scores: torch.Tensor
    ledger: PrivacyLedger


class AuditSetup(Protocol):
    """How one family is audited. ``observe`` runs the family's recipe on a tiny model whose dataset holds
    exactly the canaries marked in ``present`` ([K] bool), and scores all K canaries from the releases."""

    default_canaries: int

    def observe(self, algorithm: str, spec: AuditSpec, present: torch.Tensor) -> Observation: ...


AUDIT_SETUPS: dict[str, AuditSetup] = {}


def register_audit(setup: AuditSetup, *algorithms: str) -> AuditSetup:
    """Audit ``algorithms`` (registered recipe names) with ``setup``."""
    for name in algorithms:
        AUDIT_SETUPS[name] = setup
    return setup


@dataclass(frozen=True)
class AuditResult:
    algorithm: str
    epsilon_claimed: float
    epsilon_lower: float
    confidence: float
    delta: float
    canaries: int
    test: ThresholdTest

    @property
    def violated(self) -> bool:
        """The run releases more than its ledger claims (with the stated confidence)."""
        return self.epsilon_lower > self.epsilon_claimed

    def statement(self) -> str:
        verdict = ("VIOLATION: the run leaks more than its ledger claims" if self.violated
                   else "consistent with the claim")
        t = self.test
        return (f"{self.algorithm}: epsilon >= {self.epsilon_lower:.3f} with confidence {self.confidence:g} "
                f"(claimed {self.epsilon_claimed:.3f} at delta {self.delta:g}; {self.canaries} canaries, "
                f"test on {t.positives} in / {t.negatives} out: {t.false_negatives} missed, "
                f"{t.false_positives} false alarms): {verdict}")


def setup_for(algorithm: str) -> AuditSetup:
    if algorithm not in AUDIT_SETUPS:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(sorted(ALGORITHMS))}")
        raise ValueError(f"algorithm {algorithm!r} has no audit setup; register one with "
                         "dpopt.audit.register_audit (see docs/audit.md). Auditable: "
                         f"{', '.join(sorted(AUDIT_SETUPS))}")
    return AUDIT_SETUPS[algorithm]


def audit(algorithm: str, spec: AuditSpec | None = None) -> AuditResult:
    """Run ``algorithm`` on canaries and bound its epsilon from below (see the module docstring)."""
    spec = spec or AuditSpec()
    setup = setup_for(algorithm)
    k = spec.canaries or setup.default_canaries
    coins = torch.Generator().manual_seed(derive_seed(spec.seed, "audit"))  # the auditor's, not the run's
    present = torch.zeros(k, dtype=torch.bool)
    present[torch.randperm(k, generator=coins)[:k // 2]] = True
    calibration = torch.rand(k, generator=coins) < spec.calibration
    seen = setup.observe(algorithm, spec, present)
    if seen.scores.shape != (k,):
        raise ValueError(f"the audit setup returned scores of shape {tuple(seen.scores.shape)}, expected ({k},)")
    test = threshold_audit(seen.scores, present, calibration, spec.delta, spec.confidence)
    return AuditResult(algorithm, seen.ledger.epsilon(spec.delta), test.epsilon_lower, spec.confidence,
                       spec.delta, k, test)


# --- parts that setups share ---------------------------------------------------------------------------

def poisson_privatizer(spec: AuditSpec, dataset_size: int) -> Privatizer:
    """Stages 3-4 and the ledger, as ``PrivacyPlan`` builds them for DP-SGD: Poisson sampling, noise
    calibrated to the spec's budget, flat clipping, secret streams keyed by fresh OS entropy (or the spec's
    secret seed)."""
    key = secret_key(spec.secret_seed)
    sampler = PoissonSampler(dataset_size, spec.sample_rate, SecretStream(key, "sampling"))
    z = noise_multiplier_for(spec.epsilon, spec.delta, sampler.participation, spec.steps)
    clipping = Clipping(spec.clip)
    noise = GaussianNoise(z, clipping.sensitivity, SecretStream(key, "noise"))
    return Privatizer(clipping, noise, sampler, PrivacyLedger())


class ReleaseRecorder(Transform):
    """Identity post-processing placed first among a step's transforms, so it sees exactly what the
    ``Privatizer`` released (one parameter's privatized statistic per step)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.releases: list[torch.Tensor] = []

    def __call__(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        self.releases.append(grads[self.index].detach().clone())
        return grads


def record_releases(optimizer: PrivateStep, index: int) -> ReleaseRecorder:
    recorder = ReleaseRecorder(index)
    optimizer.transforms.insert(0, recorder)
    return recorder


def poisson_gaussian_llr(x: torch.Tensor, rate: float, noise_multiplier: float) -> torch.Tensor:
    """Log-likelihood ratio of "in" vs "out" for a canary observed as x [K, T] in units of the clip bound:
    out, x_t = z xi_t; in, x_t = b_t + z xi_t with b_t ~ Bernoulli(q) (Poisson sampling, Gaussian noise):
    sum_t log(1 - q + q exp((2 x_t - 1) / (2 z^2))), the most powerful test between the two (Neyman-Pearson)."""
    a = (2.0 * x.double() - 1.0) / (2.0 * noise_multiplier ** 2)
    if rate >= 1.0:
        return a.sum(1)
    return torch.logaddexp(torch.full_like(a, math.log1p(-rate)), a + math.log(rate)).sum(1)
