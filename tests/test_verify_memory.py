"""The attribution check before the first release holds one example's reference gradients and one parameter's
per-example gradients at a time, not every example's gradients of the whole model at once (which took OPT-1.3B
past its 14 GB memory cap before any DP method's first step)."""

import torch
from torch import nn

from dpopt import bench
from dpopt.grad import PerExampleEngine


def test_the_attribution_check_needs_about_one_gradient_of_the_model_not_three():
    torch.manual_seed(0)
    d = 512
    model = nn.Sequential(*(layer for _ in range(4) for layer in (nn.Linear(d, d), nn.Tanh())))
    engine = PerExampleEngine(model, lambda m, x: m(x).square().mean(1))
    x = torch.randn(3, d)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    start = bench._live_tensor_bytes()
    peak = bench.peak_tensor_mb(lambda: engine.verify(x)) * 2**20 - start
    # one reference gradient of the model, and one layer's per-example gradient as it is formed (two copies): 1.5x
    # (three per-example gradients, the reference and its concatenation before: 5x)
    assert peak < 2.2 * params, f"the check allocated {peak / params:.2f} times the parameters' bytes"
