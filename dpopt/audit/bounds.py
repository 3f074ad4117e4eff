"""The statistical core of the audit: a threshold test on canary scores, Clopper-Pearson bounds on its
error rates, and the smallest epsilon those rates allow.

DP as hypothesis testing (Kairouz, Oh, Viswanath 2015, Thm 2.1): if a mechanism is (epsilon, delta)-DP,
every test of "the canary is in" vs "it is out" on its output has

    1 - FNR <= e^eps * FPR + delta    and    1 - FPR <= e^eps * FNR + delta,

so measured rates give eps >= max(log((1 - delta - FNR) / FPR), log((1 - delta - FPR) / FNR)). With
upper confidence bounds on FPR and FNR (one-sided Clopper-Pearson, each at level alpha/2, so both hold
together with probability >= 1 - alpha), the result is a lower bound on epsilon that holds with confidence
1 - alpha (Jagielski, Ullman, Oprea 2020, "Auditing differentially private machine learning", Sec. 3).

The trials must be independent draws of the same test: the canaries' scores are split at random into a
calibration part, which only picks the threshold, and an evaluation part, on which the rates are counted
(picking the threshold on the counted trials would void the confidence statement).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import beta


def clopper_pearson_upper(errors: np.ndarray | int, trials: np.ndarray | int, alpha: float) -> np.ndarray:
    """One-sided upper confidence bound at level 1 - alpha on a binomial rate after ``errors`` of ``trials``:
    the (1 - alpha) quantile of Beta(k + 1, n - k), and 1 when k = n (Clopper & Pearson 1934)."""
    k, n = np.asarray(errors, dtype=float), np.asarray(trials, dtype=float)
    if np.any(n < 1) or np.any(k < 0) or np.any(k > n):
        raise ValueError("Clopper-Pearson needs 0 <= errors <= trials and trials >= 1")
    full = k >= n
    return np.where(full, 1.0, beta.ppf(1.0 - alpha, k + 1.0, np.where(full, 1.0, n - k)))


def epsilon_from_rates(fpr: np.ndarray | float, fnr: np.ndarray | float, delta: float) -> np.ndarray:
    """The smallest epsilon for which (epsilon, delta)-DP allows a test with these error rates (>= 0)."""
    fpr, fnr = np.asarray(fpr, dtype=float), np.asarray(fnr, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        one = np.log(np.maximum(1.0 - delta - fnr, 0.0) / fpr)
        other = np.log(np.maximum(1.0 - delta - fpr, 0.0) / fnr)
    best = np.fmax(np.nan_to_num(one, nan=-np.inf), np.nan_to_num(other, nan=-np.inf))
    return np.maximum(best, 0.0)


def epsilon_lower_bound(false_positives: np.ndarray | int, negatives: int, false_negatives: np.ndarray | int,
                        positives: int, delta: float, confidence: float) -> np.ndarray:
    """Epsilon lower bound with the given confidence from a test's error counts: Clopper-Pearson upper
    bounds on FPR and FNR, each at level (1 - confidence) / 2, turned into epsilon."""
    alpha = 1.0 - confidence
    fpr = clopper_pearson_upper(false_positives, negatives, alpha / 2)
    fnr = clopper_pearson_upper(false_negatives, positives, alpha / 2)
    return epsilon_from_rates(fpr, fnr, delta)


@dataclass(frozen=True)
class ThresholdTest:
    """Guess "in" when a canary's score is >= ``threshold``; the counts are on the evaluation canaries."""

    threshold: float
    false_positives: int
    negatives: int
    false_negatives: int
    positives: int
    epsilon_lower: float


def _errors(scores: np.ndarray, present: np.ndarray, thresholds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """False positives (out canaries scoring >= t) and false negatives (in canaries scoring < t) per t."""
    outs, ins = np.sort(scores[~present]), np.sort(scores[present])
    fp = len(outs) - np.searchsorted(outs, thresholds, side="left")
    fn = np.searchsorted(ins, thresholds, side="left")
    return fp, fn


def best_threshold(scores: np.ndarray, present: np.ndarray, delta: float, confidence: float,
                   candidates: int = 2000) -> float:
    """The threshold whose test gives the largest epsilon lower bound on these (calibration) canaries. The
    candidates are order statistics spaced geometrically from both ends, where the bound is decided."""
    ordered = np.sort(scores)
    n = len(ordered)
    ranks = np.geomspace(1, n, candidates)
    positions = np.unique(np.concatenate([n - ranks, ranks - 1]).round().astype(int).clip(0, n - 1))
    thresholds = ordered[positions]
    fp, fn = _errors(scores, present, thresholds)
    bounds = epsilon_lower_bound(fp, int((~present).sum()), fn, int(present.sum()), delta, confidence)
    return float(thresholds[int(np.argmax(bounds))])


def threshold_audit(scores: torch.Tensor, present: torch.Tensor, calibration: torch.Tensor, delta: float,
                    confidence: float) -> ThresholdTest:
    """Pick the threshold on the ``calibration`` canaries, count the errors on the others and bound epsilon."""
    s, p, c = (t.detach().cpu().numpy() for t in (scores.double(), present.bool(), calibration.bool()))
    if not np.all(np.isfinite(s)):
        raise ValueError("canary scores must be finite")
    for name, part in (("calibration", c), ("evaluation", ~c)):
        if p[part].all() or not p[part].any():
            raise ValueError(f"the {name} canaries must include both present and absent ones; use more canaries")
    threshold = best_threshold(s[c], p[c], delta, confidence)
    fp, fn = _errors(s[~c], p[~c], np.array([threshold]))
    negatives, positives = int((~p[~c]).sum()), int(p[~c].sum())
    eps = float(epsilon_lower_bound(fp, negatives, fn, positives, delta, confidence)[0])
    return ThresholdTest(threshold, int(fp[0]), negatives, int(fn[0]), positives, eps)
