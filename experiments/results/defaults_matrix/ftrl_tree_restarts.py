"""DP-FTRL's tree restarted every epoch (Kairouz et al. 2021, multi-epoch DP-FTRL) against one tree over the
run: the RMS noise on the prefix sums at unit noise multiplier, ||A C^+||_F sens(C) / sqrt(T), with the
least-squares decoder (dpopt's default), each example once per epoch of `period` steps, fixed order."""
import math
import torch
from dpopt.noise import factorizations as fz

def rms_error(a: torch.Tensor, c: torch.Tensor, period: int) -> tuple[float, float]:
    sens = fz.sensitivity(c, period)
    return float((a @ torch.linalg.pinv(c)).norm() * sens / math.sqrt(a.shape[1])), sens

for period, epochs in [(32, 20), (64, 20), (128, 20), (128, 5)]:
    steps = period * epochs
    prefix = torch.tril(torch.ones(steps, steps, dtype=torch.float64))
    one, s1 = rms_error(prefix, fz.tree_nodes(steps, True)[0], period)
    restarted, sr = rms_error(prefix, torch.block_diag(*[fz.tree_nodes(period, True)[0]] * epochs), period)
    iid = math.sqrt(epochs) * float(prefix.norm()) / math.sqrt(steps)
    print(f"period {period}, {epochs} epochs: one tree {one:.1f} (sensitivity {s1:.1f}), restarted every epoch "
          f"{restarted:.1f} (sensitivity {sr:.1f}), iid noise {iid:.1f}")
