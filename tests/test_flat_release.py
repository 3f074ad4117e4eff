"""The flat noise stream (chunk j of the concatenated statistic keyed by (key, step, j)) and the release of a
logical step's sums as one flat buffer."""

import pytest
import torch
from torch import nn

from dpopt.algorithms import SGD, Privatizer, build_algorithm
from dpopt.algorithms.base import as_param_dtypes
from dpopt.clipping import Clipping
from dpopt.data.samplers import FixedOrderSampler
from dpopt.flat import flat_view, zeros
from dpopt.grad import PerExampleEngine
from dpopt.noise import rng
from dpopt.noise.gaussian import GaussianNoise
from dpopt.noise.rng import SecretStream, derive_seed
from dpopt.privacy import PrivacyLedger
from helpers import mlp_loss

CHUNK = 1000  # a small NOISE_CHUNK: many chunks in a few thousand elements
SHAPES = [torch.Size([30, 40]), torch.Size([]), torch.Size([0]), torch.Size([7, 100]), torch.Size([2999])]
TOTAL = sum(s.numel() for s in SHAPES)  # 4900: 5 chunks, the last one short


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(rng, "NOISE_CHUNK", CHUNK)


def by_definition(stream: SecretStream, step: int, total: int, chunk: int) -> torch.Tensor:
    """Chunk j of the flat statistic: randn of its length from a generator seeded by (key, step, j)."""
    return torch.cat([torch.randn(min(chunk, total - a), generator=torch.Generator().manual_seed(
        derive_seed(stream._key, step, a // chunk))) for a in range(0, total, chunk)])


def flat_draw(stream: SecretStream, step: int, total: int = TOTAL, **kwargs) -> torch.Tensor:
    return stream.add_normal_flat_(torch.zeros(total), step, **kwargs)


def test_flat_draw_is_each_chunk_drawn_by_its_key(small_chunks):
    stream = SecretStream(5, "noise")
    assert torch.equal(flat_draw(stream, 3), by_definition(stream, 3, TOTAL, CHUNK))


def test_flat_draw_with_the_real_chunk_size():
    stream = SecretStream(5, "noise")
    total = rng.NOISE_CHUNK + 4321
    assert torch.equal(flat_draw(stream, 2, total), by_definition(stream, 2, total, rng.NOISE_CHUNK))


@pytest.mark.parametrize("offset,length", [(0, 10), (250, 500), (990, 20), (999, 2002), (3000, 1900), (4899, 1)])
def test_a_coordinate_range_is_the_slice_of_the_whole_draw(small_chunks, offset, length):
    stream = SecretStream(5, "noise")
    part = stream.add_normal_flat_(torch.zeros(length), 4, offset=offset, total=TOTAL)
    assert torch.equal(part, flat_draw(stream, 4)[offset:offset + length])


def test_a_range_must_lie_in_the_statistic():
    with pytest.raises(ValueError, match="1-D slice"):
        SecretStream(5, "noise").add_normal_flat_(torch.zeros(10), 0, offset=5, total=12)
    with pytest.raises(ValueError, match="1-D slice"):
        SecretStream(5, "noise").add_normal_flat_(torch.zeros(2, 5), 0)


def test_the_list_form_is_the_flat_draw_on_views_and_on_separate_tensors(small_chunks):
    stream = SecretStream(5, "noise")
    whole = flat_draw(stream, 6, std=2.5)
    on_views = stream.add_normal_(zeros(SHAPES, torch.float32, "cpu"), 6, std=2.5)
    separate = stream.add_normal_([torch.zeros(s) for s in SHAPES], 6, std=2.5)
    for got in (on_views, separate):
        assert [t.shape for t in got] == SHAPES
        assert torch.equal(torch.cat([t.reshape(-1) for t in got]), whole)
    normals = stream.normals(SHAPES, 6)
    assert flat_view(normals) is not None  # views of one buffer
    assert torch.equal(flat_view(normals), by_definition(stream, 6, TOTAL, CHUNK))


def test_the_draw_is_replayable_and_keyed_by_key_label_and_step(small_chunks):
    a = flat_draw(SecretStream(5, "noise"), 3)
    assert torch.equal(a, flat_draw(SecretStream(5, "noise"), 3))
    for other in (flat_draw(SecretStream(5, "noise"), 4), flat_draw(SecretStream(6, "noise"), 3),
                  flat_draw(SecretStream(5, "sampling"), 3), flat_draw(SecretStream(b"k" * 32, "noise"), 3)):
        assert not torch.equal(a[:CHUNK], other[:CHUNK]) and not torch.equal(a[-CHUNK:], other[-CHUNK:])
    assert not torch.equal(a[:CHUNK], a[CHUNK:2 * CHUNK])  # chunks are independent draws


def test_the_thread_count_does_not_change_the_draw(small_chunks):
    stream, threads = SecretStream(5, "noise"), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = flat_draw(stream, 3)
        torch.set_num_threads(4)  # chunks drawn by a pool of 4 threads
        four = flat_draw(stream, 3)
        separate = stream.add_normal_([torch.zeros(s) for s in SHAPES], 3)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, four)
    assert torch.equal(torch.cat([t.reshape(-1) for t in separate]), one)


def test_secure_mode_adds_float64_noise_rounded_once_across_chunks(small_chunks, monkeypatch):
    draws = torch.randn(TOTAL, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    used = []

    def os_normal(n: int) -> torch.Tensor:  # successive pieces of ``draws``, in the order they are asked for
        start = sum(used)
        used.append(n)
        return draws[start:start + n]

    monkeypatch.setattr(rng, "_os_normal", os_normal)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # one thread: the chunks are asked for in order
    x = torch.randn(TOTAL, generator=torch.Generator().manual_seed(2))
    sums = zeros(SHAPES, torch.float32, "cpu")
    flat_view(sums).copy_(x)
    got = torch.cat([t.reshape(-1) for t in SecretStream(None, "noise").add_normal_(sums, 0, std=3.3)])
    assert used == [CHUNK] * 4 + [TOTAL - 4 * CHUNK]
    assert torch.equal(got, (x.double() + 3.3 * draws).float())
    assert not torch.equal(got, x + (3.3 * draws).float())


def privatizer(noise_multiplier: float, clip: float, n: int) -> Privatizer:
    noise = GaussianNoise(noise_multiplier, clip, SecretStream(11, "noise"))
    return Privatizer(Clipping(clip), noise, FixedOrderSampler(n, n, SecretStream(0, "sampling")), PrivacyLedger())


def test_a_private_step_in_float64_is_the_sum_plus_noise_over_the_normaliser():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    z, clip, lr = 1.3, 0.05, 0.7
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    expected = [torch.zeros_like(p) for p in params]
    for i in range(8):  # sum_i clip(g_i), by hand
        grads = torch.autograd.grad(mlp_loss(model, (x[i:i + 1], y[i:i + 1])).sum(), params)
        norm = torch.sqrt(sum(g.square().sum() for g in grads))
        for e, g in zip(expected, grads):
            e.add_(g * min(1.0, clip / float(norm)))
    noise = SecretStream(11, "noise").normals([p.shape for p in params], 0, dtype=torch.float64)
    p = privatizer(z, clip, 8)
    opt = build_algorithm("dp-sgd", PerExampleEngine(model, mlp_loss), p, SGD(lr=lr),
                          physical_batch_size=3)  # three physical batches, added up
    opt.step((x, y))
    for b, a, s, n in zip(before, params, expected, noise):
        torch.testing.assert_close(b - a.detach(), lr * (s + z * clip * n) / 8, rtol=1e-12, atol=1e-15)


def test_the_released_sums_are_one_flat_buffer_with_the_right_std():
    model = nn.Sequential(nn.Linear(300, 300), nn.Linear(300, 500))
    p = privatizer(2.0, 0.5, 1000)
    opt = build_algorithm("dp-sgd", PerExampleEngine(model, mlp_loss), p, SGD(lr=1.0))
    released = opt.released(None)  # an empty batch: noise alone
    flat = flat_view(released)
    assert flat is not None and flat.numel() == sum(q.numel() for q in model.parameters())
    assert abs(float(flat.std()) / (2.0 * 0.5 / 1000) - 1) < 0.01
    assert abs(float(flat.mean())) < 0.01 * float(flat.std())


def test_releasing_separate_tensors_equals_releasing_views(small_chunks):
    shapes = [torch.Size([30, 40]), torch.Size([7]), torch.Size([2, 1500])]
    values = [torch.randn(s, generator=torch.Generator().manual_seed(k)) for k, s in enumerate(shapes)]
    views = zeros(shapes, torch.float32, "cpu")
    for v, t in zip(views, values):
        v.copy_(t)
    a = privatizer(1.5, 2.0, 50).release([t.clone() for t in values], 9)
    b = privatizer(1.5, 2.0, 50).release(views, 9)
    assert flat_view(a) is None and flat_view(b) is not None
    for s, t, v in zip(values, a, b):
        assert torch.equal(t, v)
        assert not torch.allclose(t, s / 50)  # noised


def test_gradients_are_handed_over_as_they_are_or_converted():
    grads = [torch.linspace(-1, 1, 6).view(3, 2), torch.tensor([0.1, -0.3])]
    same = as_param_dtypes(grads, [torch.zeros(3, 2), torch.zeros(2)])
    assert all(g is h for g, h in zip(same, grads))
    half = as_param_dtypes(grads, [torch.zeros(3, 2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.bfloat16)])
    for g, h in zip(grads, half):
        assert h.dtype == torch.bfloat16 and torch.equal(h, g.to(torch.bfloat16))
    mixed = as_param_dtypes(grads, [torch.zeros(3, 2, dtype=torch.float64), torch.zeros(2)])
    assert mixed[0].dtype == torch.float64 and torch.equal(mixed[0], grads[0].double()) and mixed[1] is grads[1]


def test_a_process_group_noises_a_flat_buffer_in_place_and_separate_tensors_alike(tmp_path):
    """``DataParallel.sum_and_noise`` (a gloo group of one): views of one flat buffer are reduced and noised in it;
    separate tensors get the same values."""
    import torch.distributed as dist
    from dpopt.distributed import DataParallel

    shapes = [torch.Size([30, 40]), torch.Size([7])]
    values = [torch.randn(s, generator=torch.Generator().manual_seed(k)) for k, s in enumerate(shapes)]
    stream = SecretStream(5, "noise")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        parallel = DataParallel()
        views = zeros(shapes, torch.float32, "cpu")
        for v, t in zip(views, values):
            v.copy_(t)
        flat = parallel.sum_and_noise(views, lambda s: stream.add_normal_(s, 3, std=2.0))
        separate = parallel.sum_and_noise([t.clone() for t in values], lambda s: stream.add_normal_(s, 3, std=2.0))
    finally:
        dist.destroy_process_group()
    assert flat_view(flat).data_ptr() == flat_view(views).data_ptr()  # no copy
    noise = stream.normals(shapes, 3)
    for a, b, t, n in zip(flat, separate, values, noise):
        assert torch.equal(a, b) and torch.equal(a, t + 2.0 * n)
