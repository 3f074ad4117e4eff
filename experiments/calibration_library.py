"""Noise calibration: dpopt's own search (``noise_multiplier_for``) against dp-accounting's
``mechanism_calibration.calibrate_dp_mechanism`` (issue 22, "Also": use a well-kept library where it does
what dpopt writes by hand, unless it measures worse).

    dpopt reproduce calibration_library [--delta 1e-5] [--out experiments/results/calibration_library]

Poisson-subsampled Gaussian, add/remove neighbours, PLD accountant. Like for like: the library is given
dpopt's own event for the release (``GaussianRelease.dp_event``) and a ``PLDAccountant`` at dpopt's fine
discretisation (``ledger.FINE`` = 1e-4, the interval at which the ledger reports epsilon), so both search the
same function epsilon(z). Three searches per setting:

* ``dpopt``: ``noise_multiplier_for`` as shipped (bracket by doubling with the coarse, pessimistic PLD, then
  secant steps on log epsilon against log z, coarse then fine, until epsilon(z) lies in [0.995 target, target]);
* ``library``: ``calibrate_dp_mechanism`` with its defaults (bracket searched from [0, 1], Brent's method,
  tol 1e-6 in z);
* ``library, dpopt bracket``: dpopt's coarse bracket handed to ``calibrate_dp_mechanism`` as an
  ``ExplicitBracketInterval`` (what a switch that kept dpopt's bracketing would run).

Every returned z is then accounted by dpopt's own ledger (``epsilon_of`` at the fine interval): the epsilon it
achieves, its ratio to the target (dpopt promises [0.995, 1]) and whether it exceeds the target (a privacy
bug). Time is CPU (``time.process_time``, one thread) and wall, of one search each, with dpopt's PLD and
calibration caches cleared before every search so none reuses another's work.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import dp_accounting as dpa
from dp_accounting import mechanism_calibration as mc
from dp_accounting import pld

from dpopt.privacy.calibrate import TIGHTNESS, _gaussian_multiplier, noise_multiplier_for
from dpopt.privacy.ledger import (COARSE, FINE, GaussianRelease, PoissonSampling, Relation, _relation,
                                  _subsampled_gaussian_pld, epsilon_of)

from experiments._report import write_table

# (sampling rate, steps, target epsilon, label)
SETTINGS = [
    (512 / 60000, 234, 1.0, "MNIST B=512, 2 epochs"),
    (512 / 60000, 234, 8.0, "MNIST B=512, 2 epochs"),
    (0.01, 1000, 3.0, "q=0.01, 10 epochs"),
    (1 / 12, 480, 1.0, "q=1/12, 40 epochs"),
    (1.0, 10, 2.0, "full batch, 10 steps"),
]
RELATION = Relation.ADD_REMOVE


def _event(q: float, steps: int, counter: list[int]):
    def make(z: float) -> dpa.DpEvent:
        counter[0] += 1
        return GaussianRelease(z, PoissonSampling(q), steps).dp_event("pld", RELATION)
    return make


def _accountant() -> pld.PLDAccountant:
    return pld.PLDAccountant(_relation(RELATION), value_discretization_interval=FINE)


def dpopt_search(q: float, steps: int, target: float, delta: float) -> float:
    return noise_multiplier_for(target, delta, PoissonSampling(q), steps, "pld", RELATION)


def library_search(q: float, steps: int, target: float, delta: float, counter: list[int]) -> float:
    return float(mc.calibrate_dp_mechanism(_accountant, _event(q, steps, counter), target, delta))


def library_in_dpopt_bracket(q: float, steps: int, target: float, delta: float, counter: list[int]) -> float:
    """dpopt's coarse bracket (the same doubling as noise_multiplier_for), then the library's Brent search."""
    def coarse(z: float) -> float:
        counter[0] += 1
        return epsilon_of([GaussianRelease(z, PoissonSampling(q), steps)], delta, "pld", RELATION, COARSE)

    lo, hi = 0.5, 1.0
    while coarse(hi) > target:
        lo, hi = hi, hi * 2.0
    while coarse(lo) <= target and lo > 1e-3:
        lo, hi = lo / 2.0, lo
    return float(mc.calibrate_dp_mechanism(_accountant, _event(q, steps, counter), target, delta,
                                           bracket_interval=mc.ExplicitBracketInterval(lo, hi)))


def timed(search, *args) -> tuple[float, int | None, float, float]:
    _subsampled_gaussian_pld.cache_clear()
    _gaussian_multiplier.cache_clear()
    counter = [0]
    wall, cpu = time.perf_counter(), time.process_time()
    if search is dpopt_search:
        calls = _count_dpopt_calls()
        z = search(*args)
        counter[0] = calls()
    else:
        z = search(*args, counter)
    return z, counter[0], time.process_time() - cpu, time.perf_counter() - wall


def _count_dpopt_calls():
    """Accountant evaluations inside noise_multiplier_for: the number of distinct (z, interval) PLDs built."""
    start = _subsampled_gaussian_pld.cache_info().misses
    return lambda: _subsampled_gaussian_pld.cache_info().misses - start


SEARCHES = [("dpopt", dpopt_search), ("library", library_search),
            ("library, dpopt bracket", library_in_dpopt_bracket)]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dpopt reproduce calibration_library")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--out", default="experiments/results/calibration_library")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    epsilon_of([GaussianRelease(1.0, PoissonSampling(0.5), 2)], a.delta)  # warm-up: imports, FFT plans

    rows = []
    for q, steps, target, label in SETTINGS:
        for name, search in SEARCHES:
            z, calls, cpu, wall = timed(search, q, steps, target, a.delta)
            eps = epsilon_of([GaussianRelease(z, PoissonSampling(q), steps)], a.delta, "pld", RELATION, FINE)
            row = {"setting": label, "sample_rate": q, "steps": steps, "target_epsilon": target, "delta": a.delta,
                   "search": name, "noise_multiplier": z, "epsilon": eps, "ratio": eps / target,
                   "within_guarantee": TIGHTNESS * target <= eps <= target, "exceeds_target": eps > target,
                   "accountant_calls": calls, "cpu_s": cpu, "wall_s": wall}
            rows.append(row)
            print(f"{label:22s} eps {target:g} {name:22s} z {z:.6f} eps {eps:.6f} ({eps / target:.5f}) "
                  f"{calls} calls, {cpu:.2f} s CPU, {wall:.2f} s wall", flush=True)

    lines = ["| setting | q | steps | target eps | search | z | achieved eps | eps / target | > target | "
             "accountant calls | CPU s | wall s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['sample_rate']:.5g} | {r['steps']} | {r['target_epsilon']:g} | "
                     f"{r['search']} | {r['noise_multiplier']:.5f} | {r['epsilon']:.5f} | {r['ratio']:.5f} | "
                     f"{'**yes**' if r['exceeds_target'] else 'no'} | {r['accountant_calls']} | "
                     f"{r['cpu_s']:.2f} | {r['wall_s']:.2f} |")
    lines.append("")
    lines.append("| search | worst eps / target | any above target | total CPU s | total wall s |")
    lines.append("|---|---|---|---|---|")
    summary = {}
    for name, _ in SEARCHES:
        mine = [r for r in rows if r["search"] == name]
        summary[name] = {"worst_ratio": min(r["ratio"] for r in mine),
                         "any_exceeds": any(r["exceeds_target"] for r in mine),
                         "cpu_s": math.fsum(r["cpu_s"] for r in mine), "wall_s": math.fsum(r["wall_s"] for r in mine)}
        s = summary[name]
        lines.append(f"| {name} | {s['worst_ratio']:.5f} | {'**yes**' if s['any_exceeds'] else 'no'} | "
                     f"{s['cpu_s']:.2f} | {s['wall_s']:.2f} |")
    out = Path(a.out)
    write_table(out, "results", {"rows": rows, "summary": summary}, lines)
    (out / "results.md").rename(out / "table.md")
    return 0
