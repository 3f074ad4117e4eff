"""The noise stage's mechanisms by name, as ``dpopt train --noise`` chooses them.

``gaussian`` is iid noise (DP-SGD); the others are correlated (``correlated.py``) and need fixed-order
batches. Factorizations are public and data-independent: they are computed once per process and shape.

| name     | mechanism                                                        | memory per step state |
|----------|------------------------------------------------------------------|-----------------------|
| tree     | binary-tree aggregation, ``sum`` or ``least-squares`` decoder      | O(d log T)            |
| sqrt     | Toeplitz square root of A (optionally cut to ``bands`` bands)      | O(bands d)            |
| banded   | Toeplitz with ``bands`` bands optimised for the workload (BandMF)  | O(bands d)            |
| mf       | dense lower-triangular C optimised for the workload, multi-epoch  | O(T d)                |
"""

from __future__ import annotations

import functools

import torch

from dpopt.noise import factorizations as fz
from dpopt.noise.correlated import CorrelatedNoise, MatrixNoise, TreeNoise
from dpopt.noise.gaussian import GaussianNoise
from dpopt.noise.rng import SecretStream
from dpopt.privacy.calibrate import noise_multiplier_for
from dpopt.privacy.ledger import CyclicPoissonSampling

NOISES = ("gaussian", "tree", "sqrt", "banded", "mf")
WORKLOADS = ("ones", "true")  # what an optimised factorization targets: prefix sums, or the run's momentum/decay
TREE_DECODERS = ("sum", "least-squares")
# The dense optimiser is O(T³) per L-BFGS iteration (≈ 1.1 s at T = 2000 on one CPU core, docs/correlated_noise.md;
# about 2 min at T = 10,000) and the dense mechanism keeps one model-sized row per past step.
MAX_DENSE_STEPS = 2048


def workload_name(momentum: float, decay: float) -> str:
    parts = ([f"momentum {momentum:g}"] if momentum else []) + ([f"decay {decay:g}"] if decay else [])
    return ", ".join(parts) or "ones"


@functools.lru_cache(maxsize=8)
def factorization(kind: str, steps: int, period: int, bands: int = 0, momentum: float = 0.0,
                  decay: float = 0.0) -> tuple[torch.Tensor, str]:
    """The normalised C (sensitivity 1 under fixed-order participation every ``period`` steps) in band storage
    (``factorizations.to_bands``) and its name. ``bands`` = 0 means all steps (sqrt) or one epoch's steps
    (banded). Toeplitz factorizations never form a T x T matrix."""
    if kind == "sqrt":
        p = bands or steps
        c = fz.toeplitz_bands(fz.sqrt_coefficients(min(p, steps)), steps)
        name = "sqrt" if p >= steps else f"sqrt-{p}-bands"
    elif kind == "banded":
        p = bands or min(period, steps)
        c = fz.toeplitz_bands(fz.optimize_banded(fz.workload_coefficients(steps, momentum, decay), p, period), steps)
        name = f"banded-{p}[{workload_name(momentum, decay)}]"
    elif kind == "mf":
        w = fz.toeplitz(fz.workload_coefficients(steps, momentum, decay), steps)
        c = fz.to_bands(fz.optimize_dense(w, period))
        name = f"mf[{workload_name(momentum, decay)}]"
    else:
        raise ValueError(f"unknown factorization {kind!r}; choose one of sqrt, banded, mf")
    return fz.normalize_bands(c, period), name


def amplified_noise(epsilon: float, delta: float, dataset_size: int, batch_size: int, steps: int,
                    workload: torch.Tensor, period: int, accountant: str = "pld",
                    relation: str = "add-remove") -> tuple[float, float]:
    """(z, noise) of amplified BandMF with cyclic ``period`` p: z is the multiplier calibrated at sampling
    rate p · batch_size / n over ceil(steps / p) releases; noise = z · ‖W C_p⁻¹‖_F · ‖c_p‖ / √T is the RMS
    noise the workload sees, in units of the clip bound, for C_p the square root of the prefix sums cut to p
    bands."""
    part = CyclicPoissonSampling(period * batch_size / dataset_size, period)
    z = noise_multiplier_for(epsilon, delta, part, steps, accountant, relation)
    return z, z * fz.single_participation_error(workload, fz.sqrt_coefficients(period))


def amplified_bands(epsilon: float, delta: float, dataset_size: int, batch_size: int, steps: int,
                    workload: torch.Tensor, accountant: str = "pld", relation: str = "add-remove",
                    largest: int = 512) -> int:
    """The period of cyclic Poisson sampling, and bands of the noise, for (epsilon, delta) over ``steps``: the
    power of two up to ``largest`` with the least ``amplified_noise`` (the trade-off of Choquette-Choo et al.
    2023, Sec. 5: more bands decorrelate more noise, fewer keep more amplification; 1 is DP-SGD)."""
    candidates = [1 << k for k in range(largest.bit_length())
                  if (1 << k) <= min(largest, steps) and (1 << k) * batch_size <= dataset_size]
    return min(candidates, key=lambda p: amplified_noise(epsilon, delta, dataset_size, batch_size, steps, workload,
                                                         p, accountant, relation)[1])


def build_noise(kind: str, noise_multiplier: float, clip: float, stream: SecretStream, horizon: int, period: int,
                decoder: str = "sum", bands: int = 0, momentum: float = 0.0,
                decay: float = 0.0) -> GaussianNoise | CorrelatedNoise:
    """The mechanism ``kind`` for a run of ``horizon`` steps whose examples recur every ``period`` steps
    (fixed order), calibrated to the clip bound ``clip``. ``momentum``/``decay`` define the workload the
    optimised factorizations target (0 and 0: prefix sums, the "ones" workload)."""
    if kind not in NOISES:
        raise ValueError(f"unknown noise {kind!r}; choose one of {', '.join(NOISES)}")
    if bands < 0:
        raise ValueError(f"bands must be >= 0 (0: the default for the mechanism), got {bands}")
    if kind == "mf" and horizon > MAX_DENSE_STEPS:
        raise ValueError(f"dense mf noise over {horizon} steps is out of reach (its optimiser costs O(T³) per iteration "
                         f"and it keeps a model-sized row per step; at most {MAX_DENSE_STEPS} steps): use --noise tree, "
                         "or banded (seconds to optimise), or fewer steps (--epochs, a larger --batch-size)")
    if kind == "gaussian":
        return GaussianNoise(noise_multiplier, clip, stream)
    if kind == "tree":
        return TreeNoise(noise_multiplier, clip, stream, horizon, period, decoder)
    c, name = factorization(kind, horizon, period, bands, momentum if kind != "sqrt" else 0.0,
                            decay if kind != "sqrt" else 0.0)
    return MatrixNoise(noise_multiplier, clip, stream, c, period, name)
