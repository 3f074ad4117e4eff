"""Sensitivity: with noise off, removing any one example moves the clipped sum by at most the bound."""

import math

import pytest
import torch
from torch import nn

from dpopt.clipping import Clipping, clip_and_sum
from dpopt.grad import PerExampleEngine
from dpopt.grad.captures import ConvOuter
from helpers import Zoo, mlp_loss, zoo_batch, zoo_loss


def single_layer_models():
    """One model per supported layer type (plus the generic fallback), with a matching batch."""
    b = 6
    img = torch.randn(b, 2, 7, 7)
    seq = torch.randn(b, 5, 4)
    y = torch.randint(0, 3, (b,))
    cases = {
        "linear-2d": (nn.Sequential(nn.Flatten(), nn.Linear(98, 3)), img),
        "linear-3d": (nn.Sequential(nn.Linear(4, 3), nn.Flatten(), nn.Linear(15, 3)), seq),
        "conv1d": (nn.Sequential(nn.Conv1d(5, 3, 2), nn.Flatten(), nn.Linear(9, 3)), seq),
        "conv2d": (nn.Sequential(nn.Conv2d(2, 3, 3, stride=2), nn.Flatten(), nn.Linear(27, 3)), img),
        "embedding": (nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(20, 3)), torch.randint(0, 10, (b, 5))),
        "layernorm": (nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Flatten(), nn.Linear(20, 3)), seq),
        "groupnorm": (nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(100, 3)), img),
        "rmsnorm": (nn.Sequential(nn.Linear(4, 4), nn.RMSNorm(4), nn.Flatten(), nn.Linear(20, 3)), seq),
    }
    return {k: (m, (x, y)) for k, (m, x) in cases.items()}


CASES = single_layer_models()


def layer_changes(engine, full, without):
    diffs = torch.stack([(a - b).square().sum() for a, b in zip(full, without)])
    groups = torch.tensor(engine.groups)
    return diffs.sum().sqrt(), torch.zeros(int(groups.max()) + 1).index_add_(0, groups, diffs).sqrt()


def check_removal(model, loss, batch, mode):
    bound = 1e-3
    engine = PerExampleEngine(model, loss)
    clipping = Clipping(bound, mode)
    grads = engine.gradients(batch)
    assert grads.sq_norms().sum(1).sqrt().max() > 10 * bound, "clipping must be active for this test to mean anything"
    full, _ = clip_and_sum(grads, clipping)
    b = grads.batch_size
    for i in range(b):
        keep = torch.tensor([j for j in range(b) if j != i])
        without, _ = clip_and_sum(engine.gradients(tuple(t[keep] for t in batch)), clipping)
        total, per_layer = layer_changes(engine, full, without)
        assert total <= bound * (1 + 1e-5)
        if mode == "per-layer":
            assert per_layer.max() <= bound / math.sqrt(len(per_layer)) * (1 + 1e-5)


@pytest.mark.parametrize("mode", ["flat", "per-layer", "automatic"])
@pytest.mark.parametrize("layer", sorted(CASES))
def test_removing_one_example_moves_the_sum_by_at_most_the_bound(layer, mode):
    model, batch = CASES[layer]
    check_removal(model, mlp_loss, batch, mode)


@pytest.mark.parametrize("mode", ["flat", "per-layer", "automatic"])
def test_zoo_sensitivity(mode):
    check_removal(Zoo(), zoo_loss, zoo_batch(6), mode)


def test_combination_is_clipped_as_one_vector():
    """A two-point statistic (as in DiSK) is clipped jointly: its clipped norm is at most the bound."""
    model, batch = Zoo(), zoo_batch()
    engine = PerExampleEngine(model, zoo_loss)
    shifted = [p.detach() + 0.3 * torch.randn_like(p) for p in engine.params]
    combo = 3.0 * engine.gradients(batch, at=shifted) - 2.0 * engine.gradients(batch)
    w, _ = Clipping(1e-3).weights(combo.sq_norms(), engine.groups)
    clipped = [m * w[:, 0].view(-1, *[1] * (m.dim() - 1)) for m in combo.materialize()]
    norms = torch.stack([c.flatten(1).square().sum(1) for c in clipped], 1).sum(1).sqrt()
    assert norms.max() <= 1e-3 * (1 + 1e-5)


@pytest.mark.parametrize("layer", ["linear-2d", "conv2d-wide"])
def test_nonfinite_examples_contribute_zero_and_are_counted(layer):
    model, (x, y) = CASES["linear-2d"]
    if layer == "conv2d-wide":  # its weight is kept factored, so the clip stage weighs it chunk by chunk
        model = nn.Sequential(nn.Conv2d(2, 16, 3, stride=2), nn.Flatten(), nn.Linear(16 * 9, 3))
    x = x.clone()
    x[2].view(-1)[1] = float("nan")
    engine = PerExampleEngine(model, mlp_loss)
    grads = engine.gradients((x, y))
    assert layer != "conv2d-wide" or isinstance(grads.terms[0][0][1], ConvOuter)
    sums, stats = clip_and_sum(grads, Clipping(0.5))
    assert stats.nonfinite == 1 and stats.examples == 6
    keep = torch.tensor([0, 1, 3, 4, 5])
    clean, _ = clip_and_sum(engine.gradients((x[keep], y[keep])), Clipping(0.5))
    for a, b in zip(sums, clean):
        assert torch.isfinite(a).all() and torch.allclose(a, b, atol=1e-7)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_bad_clip_bound(bad):
    with pytest.raises(ValueError, match="clip bound"):
        Clipping(bad)


def test_unknown_clipping_mode():
    with pytest.raises(ValueError, match="flat, per-layer, automatic"):
        Clipping(1.0, "elementwise")
