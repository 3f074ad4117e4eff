"""Accounting for correlated noise (tree aggregation, matrix factorizations).

A run of ``horizon`` steps with correlated noise releases C·X + Z once: it is ONE Gaussian mechanism whose
sensitivity is the factorization's (spec ``dp_srgd.md`` §2.2; Denisov et al. 2022 for adaptively chosen X
when C is lower-triangular). ``noise_multiplier`` z is the noise std relative to that sensitivity (times
the clip bound) over the whole horizon. Steps are recorded one at a time and merge into one entry while
they continue the same run; an entry covering the first s steps is accounted with the sensitivity of what
those steps release (``sensitivity``, a fraction <= 1 of the whole run's), so an early-stopped or
interrupted run is never under-reported, and never charged more than the whole run.

Over several epochs the sensitivity assumes each example sits at the same position of every epoch
(``FixedOrderParticipation``); a single-epoch run accepts any fixed participation whose period covers the
horizon. Plain Poisson sampling is refused. The one amplified case is banded noise under cyclic Poisson
sampling (``CyclicPoissonSampling`` with a period >= the bands, C's columns normalised for one participation):
an example's steps are >= bands apart, so each one moves a disjoint block of rows of C·X, and the run is
accounted exactly as iid Gaussian noise with that sampling (Choquette-Choo et al. 2023, Thm 4; ``amplified``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from dpopt.lazy import LazyModule
from dpopt.privacy.ledger import (AccountingError, CyclicPoissonSampling, FixedOrderParticipation, FixedParticipation,
                                  GaussianRelease, Participation, PoissonSampling, Relation, Release, _relation,
                                  participation_from_dict, participation_to_dict, register_release)

dpa = LazyModule("dp_accounting")  # imported when epsilon is first asked for
pld_lib = LazyModule("dp_accounting.pld.privacy_loss_distribution")


def amplified(participation: Participation, horizon: int, period: int, bands: int | None) -> bool:
    """Whether noise with ``bands`` bands (None: not banded), its sensitivity computed for examples recurring
    every ``period`` steps, is accounted with amplification by ``participation``: only under cyclic Poisson
    sampling whose groups recur no sooner than every ``bands`` steps, with the sensitivity of one
    participation (period >= horizon). Then C's columns for one group's steps t, t + p, ... touch the disjoint
    rows [t, t + bands), and each block is one subsampled Gaussian release (Choquette-Choo et al. 2023, Thm 4).
    Refuses cyclic sampling that does not meet these conditions."""
    if not isinstance(participation, CyclicPoissonSampling):
        return False
    if bands is None or bands > participation.period or period < horizon:
        raise AccountingError(
            f"cyclic Poisson sampling amplifies banded noise (--noise banded or sqrt) whose bands do not exceed "
            f"its period ({participation.period}); this noise has "
            + ("no bands" if bands is None else f"{bands} bands" if bands > participation.period
               else "a multi-epoch sensitivity") + ": use --bands at most the period, or --sampling fixed")
    return True


def check_correlated_participation(participation: Participation, horizon: int, period: int) -> None:
    """Refuse a sampling that the factorization's sensitivity does not cover (cyclic Poisson sampling is
    covered by banded noise only, through ``amplified``; here it is refused)."""
    amplified(participation, horizon, period, None)
    if isinstance(participation, PoissonSampling):
        raise AccountingError("correlated noise (tree aggregation, matrix factorizations) has no privacy analysis "
                              "with Poisson amplification; use fixed-order batches (--sampling fixed), or cyclic "
                              "Poisson sampling with banded noise (--sampling cyclic)")
    if not isinstance(participation, FixedParticipation):
        raise AccountingError(f"correlated noise cannot account participation {participation!r}")
    if horizon <= period:  # single epoch: at most one participation in the whole run, at any position
        if participation.period < horizon:
            raise AccountingError(f"this correlated noise was built for one participation in {horizon} steps, but "
                                  f"examples recur every {participation.period} steps")
        return
    if not (isinstance(participation, FixedOrderParticipation) and participation.period == period):
        raise AccountingError(f"correlated noise over several epochs needs every example at the same position of "
                              f"each {period}-step epoch (fixed order, --sampling fixed), got {participation!r}; "
                              "reshuffled epochs are not covered by its sensitivity")


@register_release
@dataclass(frozen=True)
class CorrelatedRelease(Release):
    """Steps [start, start + steps) of one correlated-noise run (see the module docstring)."""

    mechanism: ClassVar[str] = "correlated-gaussian"
    noise_multiplier: float
    factorization: str  # e.g. "tree-sum", "mf-true"; names the mechanism in statements
    horizon: int
    period: int
    participation: Participation
    sensitivity: float = 1.0  # of what steps [0, start + steps) release, relative to the whole run's
    start: int = 0
    steps: int = 1

    def __post_init__(self) -> None:
        if not self.noise_multiplier >= 0.0:
            raise ValueError(f"noise multiplier must be >= 0, got {self.noise_multiplier}")
        if not 0.0 < self.sensitivity <= 1.0 + 1e-12:
            raise ValueError(f"relative sensitivity must lie in (0, 1], got {self.sensitivity}")
        if self.start < 0 or self.steps < 0:
            raise ValueError("start and steps must be >= 0")

    def same_mechanism(self, other: Release) -> bool:
        """Merge only a release that continues this entry's run (the next step of the same mechanism)."""
        run = dict(sensitivity=1.0, start=0, steps=0)
        return (isinstance(other, CorrelatedRelease) and replace(self, **run) == replace(other, **run)
                and other.start == self.start + self.steps)

    def merge(self, other: Release) -> "CorrelatedRelease":
        assert isinstance(other, CorrelatedRelease)
        return replace(self, steps=self.steps + other.steps, sensitivity=max(self.sensitivity, other.sensitivity))

    def _effective(self) -> float:
        check_correlated_participation(self.participation, self.horizon, self.period)
        if self.start + self.steps > self.horizon:
            raise AccountingError(f"a correlated-noise run covers at most its horizon of {self.horizon} steps; "
                                  f"this entry reaches step {self.start + self.steps}")
        return self.noise_multiplier / self.sensitivity

    def dp_event(self, accountant: str, relation: Relation) -> dpa.DpEvent:
        z = self._effective()
        if relation == Relation.REPLACE_ONE and accountant == "rdp":  # as GaussianRelease: PLD doubles itself
            z = z / 2.0
        return dpa.GaussianDpEvent(z)

    def pld(self, relation: Relation, interval: float) -> pld_lib.PrivacyLossDistribution:
        return pld_lib.from_gaussian_mechanism(self._effective(), value_discretization_interval=interval,
                                               neighboring_relation=_relation(relation))

    def describe(self, unit: str) -> str:
        return (f"steps {self.start}..{self.start + self.steps - 1} of one {self.factorization} correlated-noise "
                f"run of {self.horizon} steps (one Gaussian mechanism), noise multiplier {self.noise_multiplier:.4g} "
                f"relative to the factorization's sensitivity; the released prefix has {self.sensitivity:.4g} of the "
                f"whole run's sensitivity; each {unit} "
                + (f"at a fixed position of every {self.period}-step epoch" if self.horizon > self.period
                   else "in at most one step") + " (no amplification assumed)")

    def to_dict(self) -> dict[str, Any]:
        return {"mechanism": self.mechanism, "noise_multiplier": self.noise_multiplier,
                "factorization": self.factorization, "horizon": self.horizon, "period": self.period,
                "participation": participation_to_dict(self.participation), "sensitivity": self.sensitivity,
                "start": self.start, "steps": self.steps}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CorrelatedRelease":
        d = dict(data)
        d.pop("mechanism")
        return cls(**{**d, "participation": participation_from_dict(d["participation"])})


def whole_run(noise_multiplier: float, factorization: str, horizon: int, period: int,
              participation: Participation) -> CorrelatedRelease:
    """The release of a complete run: what calibration targets."""
    return CorrelatedRelease(noise_multiplier, factorization, horizon, period, participation, 1.0, 0, horizon)


def zcdp_noise_multiplier(epsilon: float, delta: float) -> float:
    """The paper's calibration of Alg. 2/3 (L441): rho-zCDP with (rho + 2 sqrt(rho ln(1/delta)), delta)-DP,
    inverted, rho = (sqrt(ln(1/delta) + epsilon) - sqrt(ln(1/delta)))^2, and noise std sqrt(1/(2 rho)) at
    sensitivity 1. Looser than the exact Gaussian accounting of the ledger; for faithful reproductions."""
    log = math.log(1.0 / delta)
    rho = (math.sqrt(log + epsilon) - math.sqrt(log)) ** 2
    return math.sqrt(1.0 / (2.0 * rho))
