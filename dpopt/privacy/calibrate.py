"""Noise calibration: the smallest noise multiplier whose run meets a target (epsilon, delta)."""

from __future__ import annotations

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

    Epsilon decreases in z, so this is a bisection on log z: first with the coarse (pessimistic) PLD, whose
    answer is a valid upper end, then with the accountant's own precision inside that bracket.
    """
    check_budget(epsilon, delta)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")

    def eps(z: float, interval: float) -> float:
        run = GaussianRelease(z, participation, steps) if release is None else release(z)
        return epsilon_of([run], delta, accountant, relation, interval)

    lo, hi = 0.5, 1.0
    while eps(hi, COARSE) > epsilon:
        lo, hi = hi, hi * 2.0
        if hi > 1e6:
            raise ValueError(f"no noise multiplier below 1e6 reaches epsilon {epsilon} at delta {delta}")
    while eps(lo, COARSE) <= epsilon and lo > 1e-3:
        lo, hi = lo / 2.0, lo
    for interval in (COARSE, FINE):
        while hi / lo > 1.0 + 1e-4 and not TIGHTNESS * epsilon <= eps(hi, interval) <= epsilon:
            mid = math.sqrt(lo * hi)
            lo, hi = (lo, mid) if eps(mid, interval) <= epsilon else (mid, hi)
        lo = min(lo, hi / 1.05)
    if eps(hi, FINE) > epsilon:
        raise AssertionError("calibration failed to meet the target")  # unreachable: COARSE >= FINE
    return float(hi)


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
