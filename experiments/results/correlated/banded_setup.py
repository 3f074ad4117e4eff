"""CPU seconds (one thread) of each stage that builds amplified BandMF's noise at MNIST's shape (T = 9,380 steps,
16 bands, one participation): `python experiments/results/correlated/banded_setup.py`. Output in banded_setup.txt;
docs/correlated_noise.md, "Optimised factorizations"."""
import time, torch
torch.set_num_threads(1)
from dpopt.noise import factorizations as fz
T, p = 9380, 16
t = time.process_time(); w = fz.toeplitz(fz.workload_coefficients(T), T); print("workload T x T", round(time.process_time() - t, 1))
t = time.process_time(); c = fz.optimize_banded(w, p, T); print("optimize_banded", round(time.process_time() - t, 1))
t = time.process_time(); C = fz.toeplitz(c, T); print("toeplitz C", round(time.process_time() - t, 1))
t = time.process_time(); C = fz.normalize_columns(C, T); print("normalize_columns", round(time.process_time() - t, 1))
t = time.process_time(); s = fz.prefix_sensitivities(C, T); print("prefix_sensitivities", round(time.process_time() - t, 1))
