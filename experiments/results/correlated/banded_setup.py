"""CPU seconds (one thread) of each stage that builds amplified BandMF's noise at MNIST's shape (T = 9,380 steps,
16 bands, one participation): `python experiments/results/correlated/banded_setup.py`. Output in banded_setup.txt;
docs/correlated_noise.md, "Optimised factorizations"."""
import time

import torch

from dpopt.noise import factorizations as fz

torch.set_num_threads(1)
T, p = 9380, 16


def timed(label: str, fn):
    start = time.process_time()
    out = fn()
    print(label, round(time.process_time() - start, 1))
    return out


w = timed("workload coefficients", lambda: fz.workload_coefficients(T))
c = timed("optimize_banded", lambda: fz.optimize_banded(w, p, T))
C = timed("toeplitz_bands", lambda: fz.toeplitz_bands(c, T))
C = timed("normalize_bands", lambda: fz.normalize_bands(C, T))
timed("band_prefix_sensitivities", lambda: fz.band_prefix_sensitivities(C, T))
