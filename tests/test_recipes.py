"""The recipes: DP-SGD is Abadi et al.'s Algorithm 1 step by step, and every recipe reduces to its stock
torch optimizer on the mean gradient when clipping never binds and there is no noise."""

import copy

import pytest
import torch
from torch import nn

from dpopt.algorithms import SGD, Adam, Privatizer, build_algorithm
from dpopt.clipping import Clipping
from dpopt.data.samplers import PoissonSampler
from dpopt.grad import PerExampleEngine
from dpopt.noise.gaussian import GaussianNoise
from dpopt.noise.rng import SecretStream
from dpopt.privacy import PrivacyLedger
from helpers import mlp_loss

N = 12


def problem():
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    return model, (torch.randn(N, 5), torch.randint(0, 3, (N,)))


def dp_optimizer(name, model, hp, z, clip, rate=1.0):
    sampler = PoissonSampler(N, rate, SecretStream(0, "sampling"))
    privatizer = Privatizer(Clipping(clip), GaussianNoise(z, clip, SecretStream(0, "noise")), sampler,
                            PrivacyLedger())
    return build_algorithm(name, PerExampleEngine(model, mlp_loss), privatizer, hp)


@pytest.mark.parametrize("name,hp,reference", [
    ("dp-sgd", SGD(lr=0.3), lambda p: torch.optim.SGD(p, lr=0.3)),
    ("dp-sgd", SGD(lr=0.3, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.9)),
    ("dp-adam", Adam(lr=0.01), lambda p: torch.optim.Adam(p, lr=0.01)),
    ("dp-adamw", Adam(lr=0.01, weight_decay=0.1), lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)),
])
def test_without_clipping_or_noise_a_recipe_is_its_torch_optimizer(name, hp, reference):
    model, data = problem()
    twin = copy.deepcopy(model)
    opt = dp_optimizer(name, model, hp, z=0.0, clip=1e6)  # rate 1: every example in every batch
    ref = reference(list(twin.parameters()))
    for _ in range(4):
        opt.step(data)
        ref.zero_grad()
        mlp_loss(twin, data).mean().backward()
        ref.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_dp_sgd_step_is_clipped_sum_plus_secret_noise_over_expected_batch():
    """theta -= lr * (sum_i g_i min(1, C/||g_i||) + N(0, sigma^2 C^2 I)) / (q N)  (Abadi et al., Alg. 1)."""
    model, data = problem()
    before = [p.detach().clone() for p in model.parameters()]
    z, clip, rate, lr = 1.3, 0.05, 0.5, 0.7
    opt = dp_optimizer("dp-sgd", model, SGD(lr=lr), z, clip, rate)
    batch_index = opt.privatizer.sampler.batch(0)
    per_example = PerExampleEngine(model, mlp_loss, "vmap").gradients(
        tuple(t[batch_index] for t in data)).materialize()
    norms = torch.stack([g.flatten(1).square().sum(1) for g in per_example], 1).sum(1).sqrt()
    assert norms.min() > clip, "clipping must bind for this test to mean anything"
    scale = (clip / norms).clamp(max=1.0)
    noise = SecretStream(0, "noise").normals([p.shape for p in before], step=0)
    opt.step(data)
    for p0, p, g, e in zip(before, model.parameters(), per_example, noise):
        clipped_sum = torch.tensordot(scale, g, dims=1)
        expected = p0 - lr * (clipped_sum + z * clip * e) / (rate * N)
        assert torch.allclose(p.detach(), expected, rtol=1e-5, atol=1e-6)
