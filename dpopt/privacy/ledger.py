"""The privacy ledger: every private release appends an entry, and epsilon is computed from it.

The ledger stores releases in dpopt's own terms (noise in units of the per-example clip bound, and how
examples participate) and builds dp-accounting events from them only when epsilon is asked for. That
indirection matters: dp-accounting's PLD and RDP accountants read a ``GaussianDpEvent`` differently
under the replace-one relation (PLD takes the noise relative to one record's bound and doubles the
distance internally; RDP ignores the relation), so an event built once and handed to both would give
one of them a wrong epsilon. Each ``Release`` type's ``dp_event`` and ``pld`` hold that knowledge.

Neighbouring relations (``Relation``):

* ``ADD_REMOVE`` — datasets differ by adding or removing one example. With fixed (non-Poisson) batches
  the batch assignment is data-independent and the example's slot is zeroed out (dp-accounting's
  REPLACE_SPECIAL); the sensitivity of a sum of clipped vectors is C either way.
* ``REPLACE_ONE`` — one example is replaced by another; the sensitivity of the sum is 2C.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import math
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar, Iterator, Union

import numpy as np

from dpopt.lazy import LazyModule

dpa = LazyModule("dp_accounting")  # imported when epsilon is first asked for
rdp = LazyModule("dp_accounting.rdp")
pld_lib = LazyModule("dp_accounting.pld.privacy_loss_distribution")


class Relation(str, enum.Enum):
    """Which datasets are neighbours (the unit of privacy is one example, or one client)."""

    ADD_REMOVE = "add-remove"
    REPLACE_ONE = "replace-one"

    @classmethod
    def _missing_(cls, value: object) -> "Relation":
        raise ValueError(f"unknown neighbouring relation {value!r}; choose one of "
                         f"{', '.join(r.value for r in cls)}")


class AccountingError(ValueError):
    """A release that the chosen accountant cannot account for exactly; it is refused, not guessed."""


@dataclass(frozen=True)
class PoissonSampling:
    """Each example joins each step's batch independently with probability ``rate`` (amplification)."""

    rate: float

    def __post_init__(self) -> None:
        if not 0.0 < self.rate <= 1.0:
            raise ValueError(f"Poisson sampling rate must lie in (0, 1], got {self.rate}")


@dataclass(frozen=True)
class CyclicPoissonSampling(PoissonSampling):
    """Examples fall into ``period`` groups by position (group j: positions j, j + period, ...); step t samples
    group t mod period only, each of its examples independently with probability ``rate``. An example thus
    has a chance to join at most one of every ``period`` consecutive steps, and a run of T steps composes
    ceil(T/period) Poisson-subsampled releases per example (b-min-sep sampling, Choquette-Choo et al. 2023,
    "Amplified Banded Matrix Factorization", Sec. 4). ``period`` 1 is plain Poisson sampling."""

    period: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.period < 1:
            raise ValueError(f"cyclic sampling period must be >= 1 step, got {self.period}")


def poisson_count(part: PoissonSampling, steps: int) -> int:
    """How many of ``steps`` consecutive Poisson-sampled steps one example can join: all of them, or for
    cyclic sampling one in every ``period`` (any window of s steps holds ceil(s/period) of one group's)."""
    return math.ceil(steps / part.period) if isinstance(part, CyclicPoissonSampling) else steps


@dataclass(frozen=True)
class FixedParticipation:
    """Each example is in at most one batch of every ``period`` consecutive steps (shuffled or fixed-order
    epochs). No amplification is assumed: a run of T steps releases each example ceil(T/period) times."""

    period: int

    def __post_init__(self) -> None:
        if self.period < 1:
            raise ValueError(f"participation period must be >= 1 step, got {self.period}")


@dataclass(frozen=True)
class FixedOrderParticipation(FixedParticipation):
    """A fixed public order: the example at position j of an epoch is in the batches of steps j, j + period,
    j + 2 period, ... and nowhere else. Accounted like FixedParticipation by iid noise; correlated noise
    (tree, matrix factorizations) over several epochs needs exactly this pattern for its sensitivity."""


Participation = Union[PoissonSampling, FixedParticipation]
_PARTICIPATIONS = {"poisson": PoissonSampling, "cyclic-poisson": CyclicPoissonSampling, "fixed": FixedParticipation,
                   "fixed-order": FixedOrderParticipation}


def participation_to_dict(part: Participation) -> dict[str, Any]:
    kind = next(k for k, cls in _PARTICIPATIONS.items() if type(part) is cls)
    return {"kind": kind, **asdict(part)}


def participation_from_dict(data: dict[str, Any]) -> Participation:
    p = dict(data)
    return _PARTICIPATIONS[p.pop("kind")](**p)


class Release:
    """A kind of private release, repeated ``steps`` times. Subclasses are frozen dataclasses that say how
    dp-accounting must see them (``dp_event`` for RDP, ``pld`` for PLD) and register themselves under a
    ``mechanism`` name for serialisation. A release an accountant cannot analyse raises AccountingError."""

    mechanism: ClassVar[str]
    steps: int

    def same_mechanism(self, other: "Release") -> bool:
        return type(self) is type(other) and replace(self, steps=0) == replace(other, steps=0)  # type: ignore

    def merge(self, other: "Release") -> "Release":
        """This entry followed by ``other`` (a ``same_mechanism`` release) as one entry."""
        return replace(self, steps=self.steps + other.steps)  # type: ignore[type-var]

    def dp_event(self, accountant: str, relation: Relation) -> dpa.DpEvent:
        raise NotImplementedError

    def pld(self, relation: Relation, interval: float) -> pld_lib.PrivacyLossDistribution:
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Release":
        raise NotImplementedError


RELEASES: dict[str, type[Release]] = {}


def register_release(cls: type[Release]) -> type[Release]:
    RELEASES[cls.mechanism] = cls
    return cls


@register_release
@dataclass(frozen=True)
class GaussianRelease(Release):
    """``steps`` releases of a clipped sum plus N(0, (noise_multiplier * C)^2 I), where C bounds one
    example's contribution (its clip norm). The statistic may be any per-example vector of norm <= C."""

    mechanism: ClassVar[str] = "gaussian"
    noise_multiplier: float
    participation: Participation
    steps: int = 1

    def __post_init__(self) -> None:
        if not self.noise_multiplier >= 0.0:
            raise ValueError(f"noise multiplier must be >= 0, got {self.noise_multiplier}")
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")

    def dp_event(self, accountant: str, relation: Relation) -> dpa.DpEvent:
        z, part = self.noise_multiplier, self.participation
        if isinstance(part, PoissonSampling):
            if relation == Relation.REPLACE_ONE and accountant == "rdp":
                raise AccountingError(
                    "the RDP accountant has no analysis of Poisson sampling under replace-one neighbours; "
                    "use --accountant pld (or the add-remove relation)")
            # dp-accounting's Poisson events take z relative to one record's bound under either relation.
            return dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(part.rate, dpa.GaussianDpEvent(z)),
                                           poisson_count(part, self.steps))
        # A plain Gaussian: PLD (built with REPLACE_ONE) doubles the distance itself, RDP does not.
        if relation == Relation.REPLACE_ONE and accountant == "rdp":
            z = z / 2.0
        return dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(z), math.ceil(self.steps / part.period))

    def pld(self, relation: Relation, interval: float) -> pld_lib.PrivacyLossDistribution:
        """Exactly what ``PLDAccountant`` composes for ``dp_event``, with the one-step PLD cached."""
        part = self.participation
        if isinstance(part, PoissonSampling):
            return _subsampled_gaussian_pld(self.noise_multiplier, part.rate, relation, interval).self_compose(
                poisson_count(part, self.steps))
        count = math.ceil(self.steps / part.period)
        return pld_lib.from_gaussian_mechanism(self.noise_multiplier / math.sqrt(count),
                                               value_discretization_interval=interval,
                                               neighboring_relation=_relation(relation))

    def to_dict(self) -> dict[str, Any]:
        return {"mechanism": self.mechanism, "noise_multiplier": self.noise_multiplier, "steps": self.steps,
                "participation": participation_to_dict(self.participation)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GaussianRelease":
        return cls(data["noise_multiplier"], participation_from_dict(data["participation"]), data["steps"])


ACCOUNTANTS = ("pld", "rdp")


# dp-accounting's PLDAccountant default; COARSE is pessimistic (never under-reports) and 10x faster.
FINE, COARSE = 1e-4, 1e-3
# A fixed grid step makes the PLD's grid, and its memory, grow with the privacy loss's range (z = 0.05 at
# MNIST's rate over 9,380 steps, epsilon 8,100: 10 GB and 163 s); past epsilon 100 the step is epsilon / this.
GRID_POINTS = 1e6
# A tiny target (an RDP bound under TINY) gets a step in proportion to it, the bound times RELATIVE_STEP, but at
# least SMALLEST_STEP, under which dp-accounting's FFT composition was seen to lose precision. Without it a step of
# 1e-4 rounded epsilon 1e-4 on digits up past every multiplier to 1e6; with it, the converged PLD puts the
# multiplier found for that target within 1 % under it (tests/test_accounting.py).
TINY, RELATIVE_STEP, SMALLEST_STEP = 0.1, 1e-5, 1e-8


@functools.lru_cache(maxsize=32)
def _subsampled_gaussian_pld(z: float, rate: float, relation: Relation,
                             interval: float) -> pld_lib.PrivacyLossDistribution:
    """One step's PLD, as ``PLDAccountant`` builds it for a PoissonSampledDpEvent(GaussianDpEvent);
    cached because building it costs far more than composing it."""
    return pld_lib.from_gaussian_mechanism(z, value_discretization_interval=interval, sampling_prob=rate,
                                           neighboring_relation=_relation(relation))


def _relation(relation: Relation) -> dpa.NeighboringRelation:
    return (dpa.NeighboringRelation.REPLACE_ONE if relation == Relation.REPLACE_ONE
            else dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)


@contextlib.contextmanager
def _quiet_absl() -> Iterator[None]:
    """dp-accounting's RDP code logs a warning per order it drops; the result accounts for that."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def epsilon_of(releases: list[Release], delta: float, accountant: str = "pld",
               relation: Relation | str = Relation.ADD_REMOVE, interval: float = FINE) -> float:
    """Epsilon at ``delta`` of the adaptive composition of ``releases``. A pure function of its arguments (the
    releases are frozen dataclasses): the last distinct calls are kept, since runs and calibrations ask it again of
    the same ledger."""
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta}")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"unknown accountant {accountant!r}; choose one of {', '.join(ACCOUNTANTS)}")
    key = (tuple(releases), delta, accountant, Relation(relation), interval)
    try:
        hash(key)
    except TypeError:  # a release type registered from outside that is not hashable: computed every time
        return _epsilon.__wrapped__(*key)
    return _epsilon(*key)


@functools.lru_cache(maxsize=256)
def _epsilon(releases: tuple[Release, ...], delta: float, accountant: str, relation: Relation,
             interval: float) -> float:
    """``epsilon_of`` of checked arguments."""
    releases = [r for r in releases if r.steps > 0]
    events = [r.dp_event(accountant, relation) for r in releases]  # refuses what cannot be accounted
    if not releases:
        return 0.0
    if any(getattr(r, "noise_multiplier", None) == 0.0 for r in releases):
        return math.inf
    if accountant == "pld":
        interval = pld_interval(releases, delta, interval)
        dist = functools.reduce(lambda a, b: a.compose(b), (r.pld(relation, interval) for r in releases))
        return float(dist.get_epsilon_for_delta(delta))
    return _rdp_epsilon(events, delta, relation)


def pld_interval(releases: list[Release], delta: float, interval: float = FINE) -> float:
    """The PLD's grid step: ``interval``, or an RDP estimate of epsilon (add-remove, which every release has)
    over ``GRID_POINTS`` where that is coarser; for a tiny target, a step in proportion to it (``TINY``). Any
    step is safe: the discretisation rounds each release's losses up, so a coarser step only loosens the bound,
    by at most step x releases (about releases / 1e6 of epsilon). The estimate is first bounded at a few integer
    orders, a fiftieth of the cost; only a bound past ``GRID_POINTS * interval`` needs the estimate itself, so the
    step is the same either way."""
    try:
        events = [r.dp_event("rdp", Relation.ADD_REMOVE) for r in releases]
    except AccountingError:
        return interval
    bound = _rdp_epsilon(events, delta, Relation.ADD_REMOVE, INTEGER_ORDERS)
    if 0.0 < bound < TINY:
        return max(SMALLEST_STEP, min(interval, bound * RELATIVE_STEP))
    if bound <= GRID_POINTS * interval:
        return interval
    estimate = _rdp_epsilon(events, delta, Relation.ADD_REMOVE)
    return max(interval, estimate / GRID_POINTS) if math.isfinite(estimate) else interval


# A subset of dp-accounting's default orders, so epsilon at these bounds epsilon at all of them from above;
# integer orders have closed forms under Poisson sampling, where fractional ones need slow series.
INTEGER_ORDERS = (2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0, 20.0, 24.0, 32.0, 48.0, 63.0, 128.0)


def _rdp_epsilon(events: list[dpa.DpEvent], delta: float, relation: Relation,
                 orders: tuple[float, ...] | None = None) -> float:
    """``orders`` None: dp-accounting's default orders."""
    orders = tuple(rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS) if orders is None else orders
    with _quiet_absl():
        curve = sum(_rdp_of(e, relation, orders) for e in events)
        return float(rdp.rdp_privacy_accountant.compute_epsilon(orders, curve, delta)[0])


def _rdp_of(event: dpa.DpEvent, relation: Relation, orders: tuple[float, ...]) -> np.ndarray:
    """What ``RdpAccountant`` composes for ``event``: a self-composition is its count times the curve of one
    release, which is cached, so epsilon after each step of a run costs microseconds (a progress bar's)."""
    count = 1
    while isinstance(event, dpa.SelfComposedDpEvent):
        count, event = count * event.count, event.event
    return count * _rdp_curve(event, relation, orders)


@functools.lru_cache(maxsize=64)
def _rdp_curve(event: dpa.DpEvent, relation: Relation, orders: tuple[float, ...]) -> np.ndarray:
    acc = rdp.RdpAccountant(orders=list(orders), neighboring_relation=_relation(relation))
    acc.compose(event)
    return acc.rdp


class PrivacyLedger:
    """An append-only record of private releases, saved with every checkpoint.

    Consecutive releases of the same mechanism are merged into one entry with a step count, so a run of
    any length keeps a short ledger and composes in one PLD self-composition. Every entry point keeps one
    (``PrivateOptimizer.ledger``, ``PrivateTrainer.ledger``, a run folder's checkpoints); built by hand, it
    accounts releases made elsewhere.

    ```python
    import math
    from dp_accounting.rdp import RdpAccountant
    from dpopt import PrivacyLedger
    from dpopt.privacy import GaussianRelease, PoissonSampling

    ledger = PrivacyLedger()                    # add-remove neighbours, PLD accounting
    for _ in range(10):                         # a step: noise multiplier 1 on Poisson batches at rate 0.05
        ledger.record(GaussianRelease(1.0, PoissonSampling(0.05)))
    assert ledger.steps == 10 and len(ledger.entries) == 1             # merged into one entry
    epsilon = ledger.epsilon(1e-5)
    assert 0 < epsilon <= ledger.epsilon(1e-5, accountant="rdp")       # RDP's bound is looser than PLD's
    assert PrivacyLedger.from_dict(ledger.to_dict()).entries == ledger.entries    # as a checkpoint keeps it

    budget = RdpAccountant(neighboring_relation=ledger.neighboring_relation)  # the rest of a privacy budget
    budget.compose(ledger.dp_event("rdp"))
    assert math.isclose(budget.get_epsilon(1e-5), ledger.epsilon(1e-5, accountant="rdp"), rel_tol=1e-9)
    ```

    :param relation: the neighbouring datasets: ``add-remove`` (one example added or removed) or
        ``replace-one`` (one example replaced: sensitivity 2C).
    :param accountant: ``pld`` (privacy loss distributions: tight) or ``rdp`` (Rényi DP: an upper bound).
    :raises ValueError: for an unknown relation or accountant.
    """

    def __init__(self, relation: Relation | str = Relation.ADD_REMOVE, accountant: str = "pld") -> None:
        if accountant not in ACCOUNTANTS:
            raise ValueError(f"unknown accountant {accountant!r}; choose one of {', '.join(ACCOUNTANTS)}")
        self.relation = Relation(relation)
        self.accountant = accountant
        self.entries: list[Release] = []
        self._cache: dict[tuple, float] = {}

    def record(self, release: Release) -> None:
        """Append one release, merged into the last entry where it is the same mechanism.

        :param release: the release (``GaussianRelease``, ``CorrelatedRelease``), with its step count.
        :raises AccountingError: for a release the ledger's accountant cannot account (RDP has no analysis of
            Poisson sampling under replace-one neighbours): refused up front, not guessed.
        """
        release.dp_event(self.accountant, self.relation)
        if self.entries and self.entries[-1].same_mechanism(release):
            self.entries[-1] = self.entries[-1].merge(release)
        else:
            self.entries.append(release)

    @property
    def steps(self) -> int:
        """The number of releases recorded (the run's private steps)."""
        return sum(e.steps for e in self.entries)

    def epsilon(self, delta: float, accountant: str | None = None) -> float:
        """The epsilon of every release recorded so far.

        :param delta: the delta to state it at.
        :param accountant: ``pld`` or ``rdp`` (None: the ledger's own).
        :returns: epsilon at ``delta`` of the adaptive composition of the entries.
        :raises AccountingError: where the accountant has no analysis of an entry (RDP, Poisson, replace-one).
        """
        kind = accountant or self.accountant
        key = (tuple(self.entries), delta, kind)
        if key not in self._cache:
            self._cache[key] = epsilon_of(self.entries, delta, kind, self.relation)
        return self._cache[key]

    @property
    def neighboring_relation(self) -> dpa.NeighboringRelation:
        """The relation a dp-accounting accountant must be built with to read ``dp_event``."""
        return _relation(self.relation)

    def dp_event(self, accountant: str | None = None) -> dpa.DpEvent:
        """Everything the ledger holds as one dp-accounting event, to compose a run with the rest of a privacy
        budget in dp-accounting: ``PLDAccountant(ledger.neighboring_relation)`` for ``accountant`` "pld" (the
        default: the ledger's own), ``RdpAccountant(neighboring_relation=ledger.neighboring_relation)`` for "rdp".
        The two read a replace-one Gaussian differently (the module docstring), hence one event per accountant;
        under add-remove they are the same event.

        :param accountant: ``pld`` or ``rdp`` (None: the ledger's own).
        :returns: a ``ComposedDpEvent`` of the entries (a ``NoOpDpEvent`` when empty).
        :raises ValueError: for an unknown accountant.
        :raises AccountingError: where that accountant has no analysis of an entry.
        """
        kind = accountant or self.accountant
        if kind not in ACCOUNTANTS:
            raise ValueError(f"unknown accountant {kind!r}; choose one of {', '.join(ACCOUNTANTS)}")
        events = [e.dp_event(kind, self.relation) for e in self.entries if e.steps > 0]
        return dpa.ComposedDpEvent(events) if events else dpa.NoOpDpEvent()

    def to_dict(self) -> dict[str, Any]:
        """The ledger as JSON-ready data (relation, accountant, entries): how checkpoints and ``privacy.json``
        keep it.

        :returns: what ``from_dict`` reads back.
        """
        return {"relation": self.relation.value, "accountant": self.accountant,
                "entries": [e.to_dict() for e in self.entries]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PrivacyLedger":
        """The ledger ``to_dict`` wrote.

        :param data: ``to_dict()``'s output (read from a checkpoint or ``privacy.json``).
        :returns: a ledger with the same entries, relation and accountant.
        :raises ValueError: for an unknown release mechanism, relation or accountant.
        """
        ledger = cls(data["relation"], data["accountant"])
        for e in data["entries"]:
            if e.get("mechanism") not in RELEASES:
                raise ValueError(f"unknown release mechanism in ledger: {e.get('mechanism')!r}")
            ledger.record(RELEASES[e["mechanism"]].from_dict(e))
        return ledger
