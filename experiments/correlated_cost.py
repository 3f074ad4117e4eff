"""Cost of correlated noise: (1) CPU time to compute each factorization for T steps, (2) per-step CPU time
of each noise mechanism against iid Gaussian noise for a model of ``--params`` parameters, and (3) the
error of the noisy prefix sums at equal privacy (H7: polylog(T) for tree/MF against sqrt(T) for iid).

    dpopt reproduce correlated_cost --steps 1000 2000 --params 1000000

All times are ``time.process_time`` with one thread (the machine is shared; wall time is not meaningful).
(1) the dense optimisation is run for ``--dense-iters`` L-BFGS iterations (each costs O(T^3)); its loss is
compared with the square-root factorization's. (2) the mechanisms are called round-robin, one step each in
turn, for ``--noise-steps`` steps on a horizon of ``--noise-horizon`` steps, so load changes hit all alike;
the dense mechanism's cost grows with the step (it keeps every past row), reported by step window.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dpopt.noise import GaussianNoise, MatrixNoise, SecretStream, TreeNoise
from dpopt.noise import factorizations as fz

RESULTS = Path(__file__).resolve().parent / "results" / "correlated"
PARTS = ("prefix_errors", "factorizations", "noise")


def cpu(fn):
    start = time.process_time()
    out = fn()
    return out, time.process_time() - start


def factorization_costs(steps: int, dense_iters: int) -> dict:
    w = fz.toeplitz(fz.workload_coefficients(steps), steps)
    row: dict = {"steps": steps}
    sqrt_c, row["sqrt_s"] = cpu(lambda: fz.normalize_columns(fz.toeplitz(fz.sqrt_coefficients(steps), steps), steps))
    row["sqrt_error"] = fz.expected_error(w, sqrt_c, steps)
    _, row["tree_sensitivity_s"] = cpu(lambda: fz.tree_prefix_sensitivities(steps, steps, True))
    for bands in (16, 64, steps):
        c, t = cpu(lambda: fz.normalize_columns(fz.toeplitz(fz.optimize_banded(w[:, 0], bands, steps), steps), steps))
        row[f"banded_{bands}_s"], row[f"banded_{bands}_error"] = t, fz.expected_error(w, c, steps)
    dense, row["dense_s"] = cpu(lambda: fz.optimize_dense(w, steps, max_iter=dense_iters))
    row["dense_iters"], row["dense_error"] = dense_iters, fz.expected_error(w, dense, steps)
    _, row["prefix_sensitivities_s"] = cpu(lambda: fz.prefix_sensitivities(dense, steps))
    print(json.dumps(row), flush=True)
    return row


def noise_costs(params: int, horizon: int, steps: int) -> dict:
    stream = SecretStream(0, "noise")
    sqrt16 = fz.normalize_bands(fz.toeplitz_bands(fz.sqrt_coefficients(16), horizon), horizon)
    sqrt_full = fz.normalize_bands(fz.toeplitz_bands(fz.sqrt_coefficients(horizon), horizon), horizon)
    mechanisms = {
        "gaussian (iid)": GaussianNoise(1.0, 1.0, stream),
        "tree, sum": TreeNoise(1.0, 1.0, stream, horizon, horizon, "sum"),
        "tree, least-squares": TreeNoise(1.0, 1.0, stream, horizon, horizon, "least-squares"),
        "banded, 16 bands": MatrixNoise(1.0, 1.0, stream, sqrt16, horizon, "sqrt-16"),
        "dense (all past rows)": MatrixNoise(1.0, 1.0, stream, sqrt_full, horizon, "sqrt"),
    }
    times: dict[str, list[float]] = {k: [] for k in mechanisms}
    buffers = [torch.zeros(params)]
    for t in range(steps):
        for name, mech in mechanisms.items():
            buffers[0].zero_()
            _, dt = cpu(lambda: mech(buffers, t))
            times[name].append(dt)
    windows = [(0, steps // 2), (steps // 2, steps)]
    result = {"params": params, "horizon": horizon, "steps": steps, "per_step_ms": {}}
    for name, ts in times.items():
        result["per_step_ms"][name] = {f"{a}-{b - 1}": 1000 * sum(ts[a:b]) / (b - a) for a, b in windows}
    print(json.dumps(result, indent=1), flush=True)
    return result


def prefix_errors(steps: int, coordinates: int = 2000) -> dict:
    """RMS error of the noisy prefix sums at noise multiplier 1 (one epoch, sensitivity 1), measured on
    ``coordinates`` independent coordinates of each mechanism's own noise."""
    stream = SecretStream(1, "noise")
    mechanisms = {
        "gaussian (iid)": GaussianNoise(1.0, 1.0, stream),
        "tree, sum": TreeNoise(1.0, 1.0, stream, steps, steps, "sum"),
        "tree, least-squares": TreeNoise(1.0, 1.0, stream, steps, steps, "least-squares"),
        "sqrt": MatrixNoise(1.0, 1.0, stream, fz.normalize_bands(fz.toeplitz_bands(fz.sqrt_coefficients(steps), steps),
                                                                    steps), steps, "sqrt"),
    }
    marks = [t for t in (1, 4, 16, 64, 256, 1024, 4096) if t <= steps]
    out = {}
    for name, mech in mechanisms.items():
        prefix = torch.zeros(coordinates)
        rms = []
        for t in range(steps):
            prefix += mech([torch.zeros(coordinates)], t)[0]
            rms.append(float(prefix.square().mean().sqrt()))
        out[name] = {"rms_at_step": {str(m): rms[m - 1] for m in marks}, "max_rms": max(rms)}
    print(json.dumps(out, indent=1), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dpopt reproduce correlated_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, nargs="+", default=[1000, 2000])
    p.add_argument("--dense-iters", type=int, default=50)
    p.add_argument("--params", type=int, default=1_000_000)
    p.add_argument("--noise-horizon", type=int, default=1000)
    p.add_argument("--noise-steps", type=int, default=100)
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS),
                   help="which measurements to run (default: all three)")
    p.add_argument("--out", default=str(RESULTS / "cost.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    runs = {"prefix_errors": lambda: prefix_errors(1024),
            "factorizations": lambda: [factorization_costs(s, args.dense_iters) for s in args.steps],
            "noise": lambda: noise_costs(args.params, args.noise_horizon, args.noise_steps)}
    result = {part: runs[part]() for part in args.parts}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0
