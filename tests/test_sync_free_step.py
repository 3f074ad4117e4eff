"""The clip stage reads the device once (docs/performance.md, "Host synchronisations per step"): its weights, counts
and losses equal those of per-example clipping done by hand, in float64 to 1e-9, for every clipping mode, in one
pass or in physical batches, with a non-finite example (weight 0, summed as zeros) and an embedding token repeated
within an example; a two-point statistic whose ghost norm cancels for one example is still recomputed exactly."""

import math

import pytest
import torch
from torch import nn

from dpopt.algorithms.base import PrivateStep, Privatizer
from dpopt.clipping import Clipping, clip_and_sum
from dpopt.data.samplers import FixedOrderSampler
from dpopt.grad.engine import PerExampleEngine
from dpopt.noise.gaussian import GaussianNoise
from dpopt.noise.rng import SecretStream
from dpopt.privacy import PrivacyLedger
from helpers import Tokens, Zoo, weighted_loss, zoo_batch, zoo_loss
from test_host_syncs import counting_syncs

B = 8


def per_example(model: nn.Module, loss_fn, data) -> list[tuple[float, list[torch.Tensor]]]:
    """Each example's loss and gradient, by autograd alone."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(B):
        loss = loss_fn(model, tuple(t[i:i + 1] for t in data))[0]
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        out.append((float(loss.detach()), [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]))
    return out


def by_hand(model: nn.Module, loss_fn, data, groups: list[int], clipping: Clipping):
    """Each example's gradient clipped as the mode says: the sums, the non-finite and clipped counts and the mean
    finite loss, in float64."""
    sums = [torch.zeros_like(p) for p in model.parameters() if p.requires_grad]
    nonfinite = clipped = 0
    losses = []
    for loss, grads in per_example(model, loss_fn, data):
        if math.isfinite(loss):
            losses.append(loss)
        sq = torch.stack([g.square().sum() for g in grads])
        if clipping.mode == "per-layer":
            per_group = torch.zeros(max(groups) + 1, dtype=sq.dtype).index_add_(0, torch.tensor(groups), sq).sqrt()
            w = (clipping.bound / math.sqrt(len(per_group)) / per_group).clamp(max=1.0)[torch.tensor(groups)]
            finite = bool(torch.isfinite(per_group).all())
        else:
            norm = sq.sum().sqrt()
            finite = bool(torch.isfinite(norm))
            w = (clipping.bound / norm).clamp(max=1.0) if clipping.mode == "flat" else \
                clipping.bound / (norm + clipping.stability)
            w = w.expand(len(grads))
        if not finite:
            nonfinite += 1
            continue
        clipped += bool((w < 1).any())
        for s, g, wk in zip(sums, grads, w):
            s.add_(g, alpha=float(wk))
    return sums, nonfinite, clipped, sum(losses) / len(losses)


def zoo_data():
    torch.manual_seed(0)
    tokens, images, y = zoo_batch(B)
    tokens[3] = tokens[3, 1]  # one token through a whole example: its embedding rows merge
    images = images.double()
    images[5, 0, 2, 2] = float("nan")  # a non-finite example
    return tokens, images, y


@pytest.mark.parametrize("strategy", ["auto", "ghost"])
@pytest.mark.parametrize("physical", [None, 3])
@pytest.mark.parametrize("mode", ["flat", "per-layer", "automatic"])
def test_the_step_is_per_example_clipping_by_hand(mode, physical, strategy):
    data = zoo_data()
    torch.manual_seed(1)
    model = Zoo().double()
    engine = PerExampleEngine(model, zoo_loss, strategy=strategy)
    norms = sorted(float(sum(g.square().sum() for g in grads).sqrt()) for loss, grads in
                   per_example(model, zoo_loss, data) if math.isfinite(loss))
    clipping = Clipping(norms[len(norms) // 2], mode)  # about half of them clipped (flat)
    want, nonfinite, clipped, loss = by_hand(model, zoo_loss, data, engine.groups, clipping)
    assert nonfinite == 1 and clipped > 0

    privatizer = Privatizer(clipping, GaussianNoise(0.0, clipping.bound, SecretStream(1, "noise")),
                            FixedOrderSampler(B, B, SecretStream(2, "sampling")), PrivacyLedger())
    opt = PrivateStep(engine, privatizer, torch.optim.SGD(engine.params, lr=1.0), verify=False,
                      physical_batch_size=physical)
    with counting_syncs() as syncs:
        sums, counts, losses = opt.clipped_sums(data, torch.arange(B))
    assert sum(syncs.values()) == math.ceil(B / (physical or B)), syncs  # one read per physical batch
    assert counts == (B, nonfinite, clipped)
    assert float(losses[0] / losses[1]) == pytest.approx(loss, rel=1e-12)
    for got, w in zip(sums, want):
        assert torch.allclose(got, w, rtol=1e-9, atol=1e-12)

    before = [p.detach().clone() for p in engine.params]
    result = opt.step(data)  # noise multiplier 0: the update is the clipped sum over the batch size, exactly
    assert (result.examples, result.nonfinite, result.clipped) == (B, nonfinite, clipped)
    assert result.loss == pytest.approx(loss, rel=1e-12)
    for p, p0, w in zip(engine.params, before, want):
        assert torch.allclose(p.detach(), p0 - w / B, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("cancel", [False, True])
def test_a_cancelling_two_point_example_is_recomputed_exactly(cancel):
    """43 g(s') - 42 g(s) with s'_2 = 42/43 s_2: example 2's combination is zero while its steps are not, its ghost
    norm cancels (the difference form's steps l (x) r and -l (x) r): after its one read the clip stage reads which
    examples to recompute, then their weighing (three reads); the clipped sum is the hand-clipped one either way."""
    torch.manual_seed(0)
    model = Tokens(6).double()
    engine = PerExampleEngine(model, weighted_loss, strategy="ghost")
    tokens, y, s = torch.randint(0, 11, (B, 5)), torch.randint(0, 3, (B,)), torch.ones(B, dtype=torch.float64)
    shifted = s.clone()
    if cancel:
        shifted[2] = 42 / 43
    stat = 43.0 * engine.gradients((tokens, y, shifted)) - 42.0 * engine.gradients((tokens, y, s))
    mixed = torch.stack([43.0 * a - 42.0 * b for a, b in zip(shifted, s)])

    def two_point(m, batch):
        return weighted_loss(m, batch[:2] + (mixed[batch[3]],))

    clipping = Clipping(0.05)
    want, nonfinite, _, _ = by_hand(model, two_point, (tokens, y, s, torch.arange(B)), engine.groups, clipping)
    with counting_syncs() as syncs:
        sums, stats = clip_and_sum(stat, clipping, release=True)
    assert sum(syncs.values()) == (3 if cancel else 1), syncs
    assert stats.nonfinite == nonfinite == 0
    for got, w in zip(sums, want):
        assert torch.allclose(got, w, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("strategy", ["auto", "ghost"])
def test_a_non_finite_example_releases_what_the_batch_without_it_releases(strategy):
    """The clip stage reads its counts before it sums: with every norm finite no sum zeroes non-finite entries; with
    a non-finite example (a NaN in its image) the sums zero them, the materialised parameters' sums formed again. The
    release, noise included, is then the batch without that example's, and finite."""
    tokens, images, y = zoo_data()
    keep = torch.arange(B) != 5  # zoo_data's non-finite example
    torch.manual_seed(1)
    engine = PerExampleEngine(Zoo().double(), zoo_loss, strategy=strategy)
    privatizer = Privatizer(Clipping(0.1), GaussianNoise(1.0, 0.1, SecretStream(1, "noise")),
                            FixedOrderSampler(B, B, SecretStream(2, "sampling")), PrivacyLedger())
    released = []
    for batch in ((tokens, images, y), (tokens[keep], images[keep], y[keep])):
        sums, stats = privatizer.clip(engine.gradients(batch))
        assert stats.nonfinite == int(len(batch[0]) == B)
        released.append(privatizer.release(sums, step=0))
    for got, want in zip(*released):
        assert torch.isfinite(got).all() and torch.allclose(got, want, rtol=1e-9, atol=1e-12)
