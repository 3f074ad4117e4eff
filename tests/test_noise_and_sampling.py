"""Secret randomness, the noise stage, samplers, and the private step's release of noise and ledger entries."""

import pytest
import torch
from torch import nn

from dpopt.algorithms import SGD, Adam, Privatizer, build_algorithm
from dpopt.clipping import Clipping
from dpopt.data.samplers import PoissonSampler, ShuffleSampler, FixedOrderSampler
from dpopt.grad import PerExampleEngine
from dpopt.noise.gaussian import GaussianNoise
from dpopt.noise.rng import SecretStream, public_generator
from dpopt.privacy import FixedParticipation, GaussianRelease, PoissonSampling, PrivacyLedger
from helpers import mlp_loss


def test_seeded_stream_is_reproducible_and_separate_from_public_randomness():
    a = SecretStream(7, "noise").normals([torch.Size([1000])], step=3)[0]
    assert torch.equal(a, SecretStream(7, "noise").normals([torch.Size([1000])], step=3)[0])
    assert not torch.equal(a, SecretStream(7, "noise").normals([torch.Size([1000])], step=4)[0])
    assert not torch.equal(a, SecretStream(7, "sampling").normals([torch.Size([1000])], step=3)[0])
    torch.manual_seed(7)
    assert not torch.allclose(a, torch.randn(1000))
    assert not torch.allclose(a, torch.randn(1000, generator=public_generator(7)))


def test_noise_draw_does_not_depend_on_threads_or_chunking_of_the_call():
    from dpopt.noise.rng import NOISE_CHUNK

    shapes = [torch.Size([3, NOISE_CHUNK // 2]), torch.Size([7])]  # the first spans two chunks
    stream = SecretStream(3, "noise")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = stream.normals(shapes, step=5)
        torch.set_num_threads(2)
        two = stream.add_normal_([torch.full(s, 1.0) for s in shapes], step=5, std=2.0)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two):
        assert torch.allclose(1.0 + 2.0 * a, b)
    flat = one[0].flatten()
    assert not torch.equal(flat[:1000], flat[NOISE_CHUNK:NOISE_CHUNK + 1000])  # chunks are independent draws
    assert abs(float(flat.std()) - 1.0) < 0.01


def test_secure_stream_draws_from_os_entropy():
    s = SecretStream(None, "noise")
    x, y = s.normals([torch.Size([200_000])], 0)[0], s.normals([torch.Size([200_000])], 0)[0]
    assert not torch.equal(x, y)
    assert abs(float(x.mean())) < 0.01 and abs(float(x.std()) - 1) < 0.01
    u = s.uniform(100_000, 0)
    assert 0 <= float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01
    with pytest.raises(RuntimeError):
        s.generator(0)


def test_gaussian_noise_std():
    noise = GaussianNoise(1.5, 0.2, SecretStream(0, "noise"))
    out = noise([torch.zeros(400_000)], step=0)[0]
    assert abs(float(out.std()) - 0.3) < 0.003


def test_poisson_sampler():
    s = PoissonSampler(10_000, 0.01, SecretStream(1, "sampling"))
    sizes = torch.tensor([len(s.batch(t)) for t in range(200)], dtype=torch.float)
    assert abs(float(sizes.mean()) - 100) < 3 and sizes.std() > 5  # variable batch sizes
    assert torch.equal(s.batch(5), s.batch(5)) and not torch.equal(s.batch(5), s.batch(6))
    tiny = PoissonSampler(100, 0.005, SecretStream(1, "sampling"))
    assert any(len(tiny.batch(t)) == 0 for t in range(50)), "empty batches occur and must be handled"
    assert s.participation == PoissonSampling(0.01) and s.normalizer == pytest.approx(100)


def test_shuffle_and_fixed_order_partition_each_epoch():
    s = ShuffleSampler(10, 4, SecretStream(1, "sampling"))
    assert s.steps_per_epoch == 3 and s.participation == FixedParticipation(3)
    for epoch in range(2):
        seen = torch.cat([s.batch(epoch * 3 + k) for k in range(3)])
        assert sorted(seen.tolist()) == list(range(10))
    assert not torch.equal(torch.cat([s.batch(k) for k in range(3)]), torch.cat([s.batch(3 + k) for k in range(3)]))
    f = FixedOrderSampler(10, 4, SecretStream(1, "sampling"))
    assert f.batch(1).tolist() == [4, 5, 6, 7] and f.batch(4).tolist() == [4, 5, 6, 7]


class FakePoisson:
    participation = PoissonSampling(0.1)
    normalizer = 10.0
    steps_per_epoch = 10

    def batch(self, step):
        return torch.arange(10)


def privatizer(sampler, z=1.0, clip=1.0):
    clipping = Clipping(clip)
    return Privatizer(clipping, GaussianNoise(z, clip, SecretStream(0, "noise")), sampler, PrivacyLedger())


def test_a_sampler_that_is_not_poisson_cannot_claim_amplification():
    with pytest.raises(ValueError, match="Poisson amplification"):
        privatizer(FakePoisson())


def test_noise_must_match_the_clip_bound():
    with pytest.raises(ValueError, match="sensitivity"):
        Privatizer(Clipping(1.0), GaussianNoise(1.0, 2.0, SecretStream(0, "noise")),
                   PoissonSampler(10, 0.5, SecretStream(0, "s")), PrivacyLedger())


def test_empty_batches_get_noise_and_are_counted():
    model = nn.Linear(300, 300)
    sampler = PoissonSampler(1000, 1e-6, SecretStream(0, "sampling"))  # batches are almost surely empty
    p = privatizer(sampler, z=2.0, clip=0.5)
    opt = build_algorithm("dp-sgd", PerExampleEngine(model, mlp_loss), p, SGD(lr=1.0))
    before = model.weight.detach().clone()
    data = (torch.randn(1000, 300), torch.randint(0, 300, (1000,)))
    result = opt.step(data)
    assert result.examples == 0
    step = (before - model.weight.detach())  # lr 1: the update is the noise / expected batch size
    expected_std = 2.0 * 0.5 / sampler.normalizer
    assert abs(float(step.std()) / expected_std - 1) < 0.02, "noise missing or mis-scaled"
    assert p.ledger.entries == [GaussianRelease(2.0, PoissonSampling(1e-6), 1)]


def test_release_is_recorded_every_step():
    model = nn.Sequential(nn.Linear(4, 3))
    p = privatizer(PoissonSampler(64, 0.25, SecretStream(0, "sampling")), z=1.0)
    opt = build_algorithm("dp-adam", PerExampleEngine(model, mlp_loss), p, Adam(lr=0.01))
    data = (torch.randn(64, 4), torch.randint(0, 3, (64,)))
    for _ in range(7):
        opt.step(data)
    assert p.ledger.steps == 7 and opt.steps == 7


def test_secure_noise_is_added_in_float64_and_rounded_once(monkeypatch):
    """Secure mode's float64 normals are added to float32 sums in float64 and rounded once, so the output is
    the correctly rounded x + std * n (not x + round(std * n), whose grid depends on the noise alone)."""
    from dpopt.noise import rng

    draws = torch.randn(4096, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(rng, "_os_normal", lambda n: draws[:n])
    x = torch.randn(4096, generator=torch.Generator().manual_seed(2))
    got = rng.SecretStream(None, "noise").add_normal_([x.clone()], step=0, std=3.3)[0]
    assert torch.equal(got, (x.double() + 3.3 * draws).float())
    assert not torch.equal(got, x + (3.3 * draws).float())
