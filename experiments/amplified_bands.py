"""Amplified BandMF's period: RMS noise on the prefix sums at equal privacy for each cyclic period, against
DP-SGD (period 1) and the fixed-order multi-epoch noise dp-memf used before; the period ``dpopt train`` picks.

    dpopt reproduce amplified_bands --shape 1437 128 20 --shape 60000 128 20 --epsilon 2

A shape is (training examples, batch, epochs): digits' and MNIST's at the defaults above. Noise is in units
of the clip bound on the prefix sums of the steps' clipped sums, the quantity the factorizations minimise
(``fz.single_participation_error``; fixed order: ``fz.expected_error`` at the one-Gaussian multiplier of the
whole run). The fixed-order factorization is dense MF up to 2,048 steps and banded with one epoch's bands
beyond (``dpopt train``'s choice on fixed-order batches; seconds to optimise at 9,380 steps).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from dpopt.noise import factorizations as fz
from dpopt.noise.mechanisms import MAX_DENSE_STEPS, amplified_bands, amplified_noise, factorization
from dpopt.privacy import FixedOrderParticipation, noise_multiplier_for
from dpopt.privacy.correlated import whole_run

RESULTS = Path(__file__).resolve().parent / "results" / "amplified_bands"


def shape_row(n: int, batch: int, epochs: int, epsilon: float, delta: float, largest: int) -> dict:
    per_epoch = round(n / batch)  # cyclic (like Poisson) sampling's steps per epoch
    steps, ones = epochs * per_epoch, fz.workload_coefficients(epochs * per_epoch)
    row: dict = {"n": n, "batch": batch, "epochs": epochs, "steps": steps, "periods": []}
    for k in range(largest.bit_length()):
        period = 1 << k
        if period > steps or period * batch > n:
            break
        z, noise = amplified_noise(epsilon, delta, n, batch, steps, ones, period)
        row["periods"].append({"period": period, "z": round(z, 4), "noise": round(noise, 2)})
    row["chosen"] = amplified_bands(epsilon, delta, n, batch, steps, ones, largest=largest)
    fixed_period = math.ceil(n / batch)
    fixed_steps = epochs * fixed_period
    kind = "mf" if fixed_steps <= MAX_DENSE_STEPS else "banded"
    start = time.process_time()
    c, name = factorization(kind, fixed_steps, fixed_period)
    part = FixedOrderParticipation(fixed_period)
    z = noise_multiplier_for(epsilon, delta, part, fixed_steps,
                             release=lambda m: whole_run(m, name, fixed_steps, fixed_period, part))
    error = fz.expected_error(fz.toeplitz(fz.workload_coefficients(fixed_steps), fixed_steps), fz.from_bands(c),
                               fixed_period)
    row["fixed_order"] = {"factorization": name, "steps": fixed_steps, "z": round(z, 4), "noise": round(z * error, 2),
                          "cpu_s": round(time.process_time() - start, 1)}
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dpopt reproduce amplified_bands")
    p.add_argument("--shape", nargs=3, type=int, action="append", metavar=("N", "BATCH", "EPOCHS"))
    p.add_argument("--epsilon", type=float, default=2.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--largest", type=int, default=512, help="the longest period tried (dpopt train's)")
    p.add_argument("--out", type=Path, default=RESULTS / "noise.json")
    a = p.parse_args(argv)
    rows = [shape_row(n, b, e, a.epsilon, a.delta, a.largest) for n, b, e in (a.shape or [[1437, 128, 20]])]
    for row in rows:
        best = min(row["periods"], key=lambda r: r["noise"])
        print(f"n {row['n']}, batch {row['batch']}, {row['epochs']} epochs ({row['steps']} steps): "
              + ", ".join(f"p {r['period']}: z {r['z']}, noise {r['noise']}" for r in row["periods"])
              + f"; chosen p {row['chosen']} (noise {best['noise']}); fixed order {row['fixed_order']['factorization']}"
              f" z {row['fixed_order']['z']}, noise {row['fixed_order']['noise']}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"epsilon": a.epsilon, "delta": a.delta, "shapes": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
