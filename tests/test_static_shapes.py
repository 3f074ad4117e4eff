"""Static batch shapes (``dpopt.data.buckets``): a batch padded to a few sizes with rows of weight 0 releases what
the batch alone releases, in float64 to 1e-9, for every clipping mode, in one pass or in physical batches, with a
non-finite example and a repeated embedding token; the padding counts nowhere (examples, non-finite, clipped,
losses); and a whole padded run equals the unpadded run for a first-order, a two-point and a zeroth-order recipe."""

import math

import pytest
import torch

from dpopt.algorithms import NON_PRIVATE, Privatizer, build_algorithm
from dpopt import hyperparameters_for
from dpopt.clipping import CLIP_MODES, Clipping, clip_and_sum
from dpopt.data.buckets import Padding, bucket_size, granularity, pad
from dpopt.data.samplers import PoissonSampler
from dpopt.grad.engine import PerExampleEngine
from dpopt.noise.gaussian import GaussianNoise
from dpopt.noise.rng import SecretStream
from dpopt.privacy import PrivacyLedger
from helpers import Zoo, zoo_loss
from test_sync_free_step import B, zoo_data


def close(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return all(torch.allclose(g, w, rtol=1e-9, atol=1e-12) for g, w in zip(got, want))


def test_a_poisson_run_sees_a_few_shapes_and_a_large_batch_wastes_at_most_an_eighth():
    for expected in (1, 16, 100, 256, 1000, 5000):
        step = granularity(expected)
        assert 1 <= step <= max(expected / 8, 2 * math.sqrt(expected)) < 2 * step  # a power of two
        sizes = torch.distributions.Poisson(float(expected)).sample((2000,)).long().clamp(min=1)
        assert all(0 <= bucket_size(int(n), expected) - n < step for n in sizes)
        assert len({bucket_size(int(n), expected) for n in sizes}) <= 7
        for physical in (7, 64):
            assert all(n <= bucket_size(n, expected, physical) <= physical for n in range(1, physical + 1))
    assert granularity(5000) == 512  # an eighth of the batch at most
    with pytest.raises(ValueError, match="cannot pad"):
        pad(torch.arange(5), 4)


@pytest.mark.parametrize("first", [0, 5], ids=["finite-padding", "non-finite-padding"])
@pytest.mark.parametrize("strategy", ["auto", "ghost"])
@pytest.mark.parametrize("mode", CLIP_MODES)
def test_padding_rows_count_nowhere(mode, strategy, first):
    """Padding copies the batch's first example (with ``first=5``, the non-finite one: padding rows are then
    non-finite too and the sums zero them without counting them)."""
    order = torch.arange(first, first + B) % B
    data = tuple(t[order] for t in zoo_data())  # example 5 of zoo_data is non-finite; 3 repeats one token
    torch.manual_seed(1)
    engine = PerExampleEngine(Zoo().double(), zoo_loss, strategy=strategy)
    clipping = Clipping(0.1, mode)
    want_sums, want = clip_and_sum(engine.gradients(data), clipping)
    rows = B + 3
    padded = tuple(t[pad(torch.arange(B), rows)] for t in data)
    got_sums, got = clip_and_sum(engine.gradients(padded), clipping, padding=Padding.of(B, rows))
    assert (got.examples, got.nonfinite, got.clipped) == (want.examples, want.nonfinite, want.clipped) == \
        (B, 1, want.clipped)
    assert got.losses[1] == want.losses[1] == B - 1 and got.losses[0] == pytest.approx(want.losses[0], rel=1e-12)
    assert close(got_sums, want_sums)
    # without the mask the padding would count: in the sums (finite padding) or as non-finite examples
    unmasked, stats = clip_and_sum(engine.gradients(padded), clipping)
    assert stats.examples == rows
    assert not close(unmasked, want_sums) if first == 0 else stats.nonfinite == 1 + rows - B


@pytest.mark.parametrize("physical", [None, 12])
@pytest.mark.parametrize("recipe", ["dp-sgd", "disk-adam", "dpzero", "mezo"])
def test_a_padded_run_is_the_unpadded_run(recipe, physical):
    """Poisson batches of 32 expected examples (padded to multiples of 8; in physical batches of 12, the last one
    to a multiple of 4): the same losses, counts and parameters, step after step, noise included (mezo: the
    non-private clip stage)."""
    tokens, images, y = zoo_data()
    n = 96
    data = (tokens.repeat(12, 1), images.repeat(12, 1, 1, 1) + torch.randn(n, 1, 1, 1, dtype=torch.float64), y.repeat(12))
    runs = []
    for static in (False, True):
        torch.manual_seed(1)
        engine = PerExampleEngine(Zoo().double(), zoo_loss)
        noise = 0.0 if recipe in NON_PRIVATE else 1.0  # a non-private baseline: its own clip stage, no noise
        privatizer = Privatizer(Clipping(0.1), GaussianNoise(noise, 0.1, SecretStream(1, "noise")),
                                PoissonSampler.with_batch_size(n, 32, SecretStream(2, "sampling")), PrivacyLedger())
        step = build_algorithm(recipe, engine, privatizer, hyperparameters_for(recipe, lr=0.05), physical)
        step.static_shapes = static
        results = [step.step(data) for _ in range(2)]
        runs.append((results, [p.detach().clone() for p in engine.params]))
    (plain, plain_params), (padded, padded_params) = runs
    assert [(r.examples, r.nonfinite, r.clipped) for r in padded] == [(r.examples, r.nonfinite, r.clipped)
                                                                      for r in plain]
    assert any(r.examples % 4 for r in plain)  # some batch was padded
    for a, b in zip(plain, padded):
        assert (a.loss is None) == (b.loss is None) and (a.loss is None or math.isclose(a.loss, b.loss, rel_tol=1e-9))
    assert close(padded_params, plain_params)
