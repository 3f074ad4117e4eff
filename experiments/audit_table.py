"""Empirical privacy audit of every auditable recipe: epsilon claimed (the run's ledger) vs the canary lower
bound (95 % confidence), at several budgets; then the deliberately broken variants of the tests
(clipping off, noise halved, the ledger told a quarter of the sampling rate), imported from
tests/broken_variants.py and applied as patches of the library's clipping, noise and sampler that are undone
after each audit, never in the library.

    dpopt reproduce audit_table [--budgets 1 2 4 8] [--deltas 1e-5 1e-3] [--seeds 5] [--out DIR]
                                [--families dp-sgd ...] [--broken-delta D]

Each audit is one small run of the recipe on its family's canaries (docs/audit.md); CPU time is measured
per audit with time.process_time on one thread.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import csv
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Iterator
from unittest import mock

import torch

from dpopt.audit import AUDIT_SETUPS, AuditSpec, audit
from dpopt.audit.canaries import ProjectedDirac

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the broken variants live there only
from broken_variants import BROKEN  # noqa: E402

BROKEN_FAMILIES = ("dp-sgd", "disk-adam", "dp-grape", "dp-galore")


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    if name == "correct":
        yield
        return
    with mock.patch.object(*BROKEN[name]):
        yield


def spec_of_the_tests(algorithm: str, seed: int) -> AuditSpec:
    """The configuration tests/test_audit.py uses (delta 1e-3 for the projected setup), with the seed as the
    secret seed too, so every row replays (seed 0: the tests' outcome)."""
    return AuditSpec(delta=1e-3 if isinstance(AUDIT_SETUPS[algorithm], ProjectedDirac) else 1e-5, seed=seed,
                     secret_seed=seed)


def one(algorithm: str, spec: AuditSpec, name: str = "correct") -> dict:
    start = time.process_time()
    with variant(name):
        result = audit(algorithm, spec)
    return {"algorithm": algorithm, "variant": name, "epsilon_target": spec.epsilon, "delta": spec.delta,
            "seed": spec.seed, "epsilon_claimed": result.epsilon_claimed, "epsilon_lower": result.epsilon_lower,
            "confidence": result.confidence, "canaries": result.canaries, "violated": result.violated,
            "cpu_s": time.process_time() - start}


def plot(budget_rows: list[dict], broken_rows: list[dict], deltas: list[float], path: Path) -> None:
    """Left: lower bound vs claim per setup and delta (the recipes of one setup give the same numbers).
    Right: the broken variants at seed 0 (the tests' configuration) against their claim."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    top = max(r["epsilon_claimed"] for r in budget_rows)
    left.plot([0, top], [0, top], "k:", label="lower = claimed")
    for algorithm in ("dp-sgd", "dp-grape"):
        for delta in deltas:
            cells = [r for r in budget_rows if r["algorithm"] == algorithm and r["delta"] == delta]
            label = f"{'first-order, DiSK' if algorithm == 'dp-sgd' else 'GRAPE, GaLore'}, delta {delta:g}"
            left.plot([r["epsilon_claimed"] for r in cells], [r["epsilon_lower"] for r in cells], "o-", label=label)
    left.set(xlabel="epsilon claimed (ledger)", ylabel="epsilon lower bound (95 %)", title="correct recipes")
    left.legend(fontsize=7)
    names = ("correct", *BROKEN)
    for j, name in enumerate(names):
        cells = [r for r in broken_rows if r["variant"] == name and r["seed"] == 0]
        right.bar([i + 0.2 * (j - 1.5) for i in range(len(cells))], [r["epsilon_lower"] for r in cells], 0.2,
                  label=name)
    right.axhline(broken_rows[0]["epsilon_claimed"], color="k", ls=":", label="claimed")
    right.set_xticks(range(len(BROKEN_FAMILIES)), BROKEN_FAMILIES)
    right.set(ylabel="epsilon lower bound (95 %)", title="broken variants (tests' configuration)")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dpopt reproduce audit_table")
    p.add_argument("--budgets", type=float, nargs="*", default=[1.0, 2.0, 4.0, 8.0],
                   help="targets of the claimed-vs-lower table (none: only the broken variants)")
    p.add_argument("--deltas", type=float, nargs="+", default=[1e-5, 1e-3])
    p.add_argument("--seeds", type=int, default=5, help="seeds of the broken-variant table (0 is the tests')")
    p.add_argument("--families", nargs="+", default=list(BROKEN_FAMILIES), help="algorithms of the broken variants")
    p.add_argument("--broken-delta", type=float, help="delta of the broken variants (default: the tests')")
    p.add_argument("--out", default="experiments/results/audit")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    budget_rows = []
    for delta in a.deltas if a.budgets else []:
        for algorithm in sorted(AUDIT_SETUPS):
            for eps in a.budgets:
                row = one(algorithm, AuditSpec(epsilon=eps, delta=delta, secret_seed=0))  # replayable
                budget_rows.append(row)
                print(f"{algorithm:10s} delta {delta:g} eps {eps:g}: claimed {row['epsilon_claimed']:.3f} "
                      f"lower {row['epsilon_lower']:.3f} ({row['cpu_s']:.1f} s CPU)", flush=True)
    broken_rows = []
    for algorithm in a.families:
        for name in ("correct", *BROKEN):
            for seed in range(a.seeds):
                spec = spec_of_the_tests(algorithm, seed)
                if a.broken_delta is not None:
                    spec = dataclasses.replace(spec, delta=a.broken_delta)
                row = one(algorithm, spec, name)
                broken_rows.append(row)
                print(f"{algorithm:10s} {name:20s} seed {seed}: claimed {row['epsilon_claimed']:.3f} "
                      f"lower {row['epsilon_lower']:.3f} ({row['cpu_s']:.1f} s CPU)", flush=True)

    rows = budget_rows + broken_rows
    (out / "audit_table.json").write_text(json.dumps(rows, indent=1))
    with open(out / "audit_table.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)

    if a.budgets:
        print("\n| algorithm | canaries | delta | " + " | ".join(f"eps {e:g}: claimed / lower" for e in a.budgets)
              + " |")
        print("|---|---|---|" + "---|" * len(a.budgets))
    for delta in a.deltas if a.budgets else []:
        for algorithm in sorted(AUDIT_SETUPS):
            cells = [r for r in budget_rows if r["algorithm"] == algorithm and r["delta"] == delta]
            print(f"| {algorithm} | {cells[0]['canaries']} | {delta:g} | "
                  + " | ".join(f"{r['epsilon_claimed']:.2f} / {r['epsilon_lower']:.2f}" for r in cells) + " |")
    print("\n| algorithm | delta | variant | claimed | lower, seed 0 (the test) | lower, min / median / max over "
          f"{a.seeds} seeds | exceeds claim |")
    print("|---|---|---|---|---|---|---|")
    for algorithm in a.families:
        for name in ("correct", *BROKEN):
            cells = [r for r in broken_rows if r["algorithm"] == algorithm and r["variant"] == name]
            lows = [r["epsilon_lower"] for r in cells]
            print(f"| {algorithm} | {cells[0]['delta']:g} | {name} | {cells[0]['epsilon_claimed']:.2f} | "
                  f"{lows[0]:.2f} | {min(lows):.2f} / {statistics.median(lows):.2f} / {max(lows):.2f} | "
                  f"{sum(r['violated'] for r in cells)}/{len(cells)} |")
    if budget_rows and a.families == list(BROKEN_FAMILIES):
        plot(budget_rows, broken_rows, a.deltas, out / "audit_table.png")
    cpu = [r["cpu_s"] for r in rows]
    print(f"\n{len(rows)} audits, CPU per audit: median {statistics.median(cpu):.2f} s, max {max(cpu):.2f} s")
    return 0
