"""Noise calibration: the smallest noise multiplier whose run meets a target (epsilon, delta)."""

from __future__ import annotations

import functools
import math
from typing import Callable

from dpopt.privacy.ledger import COARSE, FINE, GaussianRelease, Participation, Relation, Release, epsilon_of

# The returned noise gives epsilon in [TIGHTNESS * target, target].
TIGHTNESS = 0.995


def check_budget(epsilon: float, delta: float) -> None:
    """Refuse a privacy target that is not a DP guarantee."""
    if not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"epsilon must be a finite number > 0, got {epsilon}")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta}")


def noise_multiplier_for(epsilon: float, delta: float, participation: Participation, steps: int,
                         accountant: str = "pld", relation: Relation | str = Relation.ADD_REMOVE,
                         release: Callable[[float], Release] | None = None) -> float:
    """The noise multiplier z (noise std / clip bound) such that ``steps`` releases with this participation
    are (epsilon, delta)-DP, with epsilon(z) in [0.995 * epsilon, epsilon]. ``release(z)``, if given, is the
    whole run's release at multiplier z for another mechanism (e.g. correlated noise's ``whole_run``); by
    default it is ``GaussianRelease(z, participation, steps)``.

    Epsilon decreases in z, and log epsilon is nearly a line in log z. So the search brackets z by doubling,
    then takes secant steps on that line: first with the coarse (pessimistic) PLD into the top fifth of the band,
    whose answer is a valid upper end, then with the accountant's own precision from there, usually one step.

    :param epsilon: the target epsilon (finite, > 0).
    :param delta: the target delta, in (0, 1).
    :param participation: how examples join the steps (``PoissonSampling(rate)``, ``FixedParticipation(period)``,
        ...): the sampler's ``participation``.
    :param steps: the run's number of releases (>= 1).
    :param accountant: ``pld`` or ``rdp``.
    :param relation: ``add-remove`` or ``replace-one``.
    :param release: the whole run's release at a multiplier, for a mechanism other than iid Gaussian noise.
    :returns: the noise multiplier z.
    :raises ValueError: for a target that is not a DP guarantee, steps < 1, or an unknown accountant or relation.
    :raises AccountingError: for a participation the accountant cannot account.
    """
    check_budget(epsilon, delta)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    relation = Relation(relation)
    if release is None:
        return _gaussian_multiplier(epsilon, delta, participation, steps, accountant, relation)
    return _search(lambda z, interval: epsilon_of([release(z)], delta, accountant, relation, interval), epsilon, delta)


@functools.lru_cache(maxsize=64)
def _gaussian_multiplier(epsilon: float, delta: float, participation: Participation, steps: int, accountant: str,
                         relation: Relation) -> float:
    """Remembered: a cyclic run calibrates each period it compares, then the chosen one again; an audit
    calibrates its many runs once."""
    return _search(lambda z, interval: epsilon_of([GaussianRelease(z, participation, steps)], delta, accountant,
                                                  relation, interval), epsilon, delta)


def _search(epsilon_at: Callable[[float, float], float], epsilon: float, delta: float) -> float:
    """The search of ``noise_multiplier_for`` on ``epsilon_at(z, interval)``."""
    eps = functools.cache(epsilon_at)

    def coarse(z: float) -> float:
        return eps(z, COARSE)

    def fine(z: float) -> float:
        return eps(z, FINE)

    lo, hi = 0.5, 1.0
    while coarse(hi) > epsilon:
        lo, hi = hi, hi * 2.0
        if hi > 1e6:
            raise ValueError(f"no noise multiplier below 1e6 reaches epsilon {epsilon} at delta {delta}")
    while coarse(lo) <= epsilon and lo > 1e-3:
        lo, hi = lo / 2.0, lo
    if coarse(lo) <= epsilon:
        return lo  # a target this loose is met at the smallest multiplier searched (and FINE <= COARSE)
    slope = (_log(coarse(hi)) - _log(coarse(lo))) / math.log(hi / lo)
    hi, slope = _into_band(coarse, epsilon, 1.0 - (1.0 - TIGHTNESS) / 5, lo, hi, slope)
    while fine(hi) > epsilon:  # the coarse PLD bounds the fine one where their grids nest, below epsilon 100
        hi *= 1.01  # (``pld_interval``); past it, step up to a valid end
    hi, _ = _into_band(fine, epsilon, TIGHTNESS, None, hi, slope)
    return float(hi)


def _into_band(eps: Callable[[float], float], epsilon: float, floor: float, lo: float | None, hi: float,
               slope: float) -> tuple[float, float]:
    """From hi with eps(hi) <= epsilon, a z with eps(z) in [floor * epsilon, epsilon], and the last slope of
    log eps in log z (negative). Each step goes from the latest point along the slope to the band's middle, kept
    inside (lo, hi), where eps(lo) > epsilon; while no lo is known, at most 5 % down. The slope is then the secant
    through the last two points. After eight steps, the bracket is halved (or, with no lo, hi lowered 5 %)
    instead. Stops where the bracket is 1e-4 wide."""
    aim = math.log(epsilon) + 0.5 * math.log(floor)
    last, steps = hi, 0
    while eps(hi) < floor * epsilon and (lo is None or hi / lo > 1.0 + 1e-4):
        newton = last * math.exp((aim - _log(eps(last))) / slope)
        if lo is None:
            z = hi / 1.05 if steps >= 8 else max(newton, hi / 1.05)
        else:
            t = 0.5 if steps >= 8 else min(max(math.log(newton / lo) / math.log(hi / lo), 0.02), 0.98)
            z = lo * (hi / lo) ** t
        if (secant := (_log(eps(z)) - _log(eps(last))) / math.log(z / last)) < 0:
            slope = secant
        if eps(z) > epsilon:
            lo = z
        else:
            hi = z
        last, steps = z, steps + 1
    return hi, slope


def _log(value: float) -> float:
    """log, with epsilon 0 (a loose target's large multipliers) taken as 1e-300."""
    return math.log(max(value, 1e-300))


def advanced_composition_noise(epsilon: float, delta: float, steps: int) -> float:
    """sigma / Delta of Lemma 2.2 in DPZero (Zhang et al. 2024, L65-69; Kairouz et al. 2015, Thm 4.3): T-fold
    adaptive composition of Gaussian mechanisms of L2 sensitivity Delta, each adding N(0, sigma^2 I) with
    sigma = 2 Delta sqrt(2 T log(e + epsilon/delta)) / epsilon, is (epsilon, delta)-DP. No subsampling: the
    paper's full-batch theory. For a clipped mean under replace-one, Delta = 2C/n, giving Alg. 1-2's
    sigma = 4 C sqrt(2 T log(e + epsilon/delta)) / (n epsilon) (L126, L186). The ledger's PLD accountant,
    given the same noise, reports a smaller epsilon: this bound is loose, kept for faithful reproductions."""
    check_budget(epsilon, delta)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return 2.0 * math.sqrt(2.0 * steps * math.log(math.e + epsilon / delta)) / epsilon
