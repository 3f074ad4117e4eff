"""DP-GRAPE: exact projected per-example gradients, public regenerable projections, flat clipping over
projected and unprojected parts, noise in the projected space, memory of the projected statistic only."""

import copy

import pytest
import torch
from torch import nn

from dpopt.algorithms import Privatizer, Projection, build_algorithm
from dpopt.algorithms.grape import GaLore
from dpopt.clipping import Clipping, clip_and_sum
from dpopt.data.samplers import FixedOrderSampler, PoissonSampler
from dpopt.grad import PerExampleEngine
from dpopt.grad.projection import RandomProjection, SVDProjection
from dpopt.noise.gaussian import GaussianNoise
from dpopt.noise.rng import SecretStream
from dpopt.privacy import PrivacyLedger
from dpopt.transforms.projected_adam import ProjectedAdam
from helpers import mlp_loss

R = 4


class Net(nn.Module):
    """Left-projected (out < in), right-projected (out > in), square, a 3-D (token) layer and a head."""

    def __init__(self):
        super().__init__()
        self.wide = nn.Linear(12, 6)     # out < in: left
        self.tall = nn.Linear(6, 10)     # out > in: right
        self.square = nn.Linear(10, 10)  # square: right
        self.head = nn.Linear(10, 3)     # a head: never projected

    def forward(self, x):  # x [B, T, 12]
        h = torch.tanh(self.square(torch.tanh(self.tall(torch.tanh(self.wide(x))))))
        return self.head(h.mean(1))


def batch(b=5, t=3):
    return torch.randn(b, t, 12), torch.randint(0, 3, (b,))


def test_projection_selects_sides():
    engine = PerExampleEngine(Net(), mlp_loss)
    proj = RandomProjection.on(engine, R, every=10, seed=0)
    names = {engine.names[i]: side for i, side in proj.sides.items()}
    assert names == {"wide.weight": "left", "tall.weight": "right", "square.weight": "right"}
    assert proj.shape(engine.names.index("wide.weight")) == (R, 12)
    assert proj.shape(engine.names.index("tall.weight")) == (10, R)
    assert tuple(proj.matrix(engine.names.index("wide.weight")).shape) == (6, R)  # the smaller side
    opt = build_algorithm("dp-grape", engine, privatizer(1.0, 1.0),
                          Projection(lr=0.01, rank=R, projection_exclude="wide, head"))
    assert {engine.names[i] for i in opt.engine.projection.sides} == {"tall.weight", "square.weight"}


@pytest.mark.parametrize("strategy", ["ghost", "materialize"])
def test_projected_per_example_gradients_are_exact(strategy):
    model, data = Net(), batch()
    ref = PerExampleEngine(model, mlp_loss, "vmap").gradients(data).materialize()
    engine = PerExampleEngine(model, mlp_loss, strategy=strategy)
    engine.projection = proj = RandomProjection.on(engine, R, every=10, seed=1)
    got = engine.gradients(data)
    for i, (g, full) in enumerate(zip(got.materialize(), ref)):
        if i in proj.sides:
            p = proj.matrix(i)
            expected = torch.einsum("mr,bmn->brn", p, full) if proj.sides[i] == "left" else full @ p
        else:
            expected = full
        assert torch.allclose(g, expected, atol=1e-6, rtol=1e-5), engine.names[i]
    norms = torch.stack([g.flatten(1).square().sum(1) for g in got.materialize()], 1)
    assert torch.allclose(got.sq_norms(), norms, rtol=1e-5)


def test_vmap_reference_path_is_projected_too():
    model, data = Net(), batch()
    got = []
    for mode in ("hooks", "vmap"):
        engine = PerExampleEngine(model, mlp_loss, mode)
        engine.projection = RandomProjection.on(engine, R, every=10, seed=1)
        got.append(engine.gradients(data).materialize())
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-5) for a, b in zip(*got))


def test_projection_is_public_regenerable_and_refreshed_every_f_steps():
    engine = PerExampleEngine(Net(), mlp_loss)
    a, b = RandomProjection.on(engine, R, every=3, seed=7), RandomProjection.on(engine, R, every=3, seed=7)
    i, j = sorted(a.sides)[:2]
    seen = []
    for step in range(7):
        a.step = b.step = step
        assert torch.equal(a.matrix(i), b.matrix(i))  # bit-identical regeneration
        seen.append(a.matrix(i))
    assert torch.equal(seen[0], seen[2]) and not torch.equal(seen[2], seen[3]) and torch.equal(seen[3], seen[5])
    assert not torch.equal(a.matrix(i)[:, :R], a.matrix(j)[: a.matrix(i).shape[0], :R])
    assert not torch.equal(a.matrix(i), RandomProjection.on(engine, R, every=3, seed=8).matrix(i))


def test_projection_is_unbiased_and_preserves_norms_in_expectation():
    engine = PerExampleEngine(nn.Sequential(nn.Linear(40, 30)), mlp_loss)
    proj = RandomProjection.on(engine, 8, every=1, seed=0)
    g = torch.randn(30, 40)
    recon, ratio = torch.zeros_like(g), 0.0
    draws = 200
    for step in range(draws):
        proj.step = step
        r = proj.project_gradient(0, g)
        recon += proj.lift(0, r) / draws
        ratio += float(r.square().sum() / g.square().sum()) / draws
    assert float((recon - g).norm() / g.norm()) < 0.25  # E[P P^T] = I, Monte Carlo error ~ sqrt(d/r/draws)
    assert abs(ratio - 1) < 0.05


def privatizer(z, clip, n=40):
    return Privatizer(Clipping(clip), GaussianNoise(z, clip, SecretStream(0, "noise")),
                      PoissonSampler(n, 0.5, SecretStream(0, "sampling")), PrivacyLedger())


def test_flat_clipping_over_projected_and_unprojected_parts():
    model, data = Net(), batch(8)
    engine = PerExampleEngine(model, mlp_loss)
    engine.projection = RandomProjection.on(engine, R, every=10, seed=0)
    clip = Clipping(1e-3)
    full, _ = clip_and_sum(engine.gradients(data), clip)
    assert [tuple(s.shape) for s in full] == [tuple(s) for s in engine.shapes]
    for i in range(8):
        keep = torch.tensor([j for j in range(8) if j != i])
        part, _ = clip_and_sum(engine.gradients((data[0][keep], data[1][keep])), clip)
        assert torch.stack([(a - b).square().sum() for a, b in zip(full, part)]).sum().sqrt() <= 1e-3 * (1 + 1e-5)


def test_noise_lives_in_the_projected_space():
    model = Net()
    engine = PerExampleEngine(model, mlp_loss)
    opt = build_algorithm("dp-grape", engine, privatizer(3.0, 0.5), Projection(lr=0.01, rank=R))
    noise, _ = opt.privatizer(None, engine.shapes, torch.device("cpu"), step=0)  # empty batch: noise alone
    unprojected = sum(p.numel() for i, p in enumerate(engine.params) if i not in engine.projection.sides)
    projected = sum(engine.shapes[i].numel() for i in engine.projection.sides)
    assert sum(n.numel() for n in noise) == projected + unprojected == R * (12 + 10 + 10) + unprojected
    big = torch.cat([n.flatten() for n in noise])
    assert abs(float(big.std()) / (3.0 * 0.5 / 20) - 1) < 0.1


def test_only_the_projected_statistic_is_held():
    """With materialised captures the per-example buffers hold B * (r * sum n + unprojected) floats."""
    model, data = Net(), batch(6, 1)
    engine = PerExampleEngine(model, mlp_loss, strategy="materialize")
    engine.projection = RandomProjection.on(engine, R, every=10, seed=0)
    held = sum(t.held_elements() for ts in engine.gradients(data).terms for _, t in ts)
    unprojected = sum(p.numel() for i, p in enumerate(engine.params) if i not in engine.projection.sides)
    assert held == 6 * (R * (12 + 10 + 10) + unprojected)


def test_same_privacy_cost_as_dp_adam_and_training_moves():
    ledgers = []
    for algorithm in ("dp-adam", "dp-grape", "dp-galore"):
        model = Net()
        data = (torch.randn(40, 3, 12), torch.randint(0, 3, (40,)))
        opt = build_algorithm(algorithm, PerExampleEngine(model, mlp_loss), privatizer(1.0, 1.0),
                              Projection(lr=0.01, rank=R, subspace_every=2))
        before = [p.detach().clone() for p in model.parameters()]
        for _ in range(4):
            opt.step(data)
        assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        ledgers.append(opt.privatizer.ledger.entries)
    assert ledgers[0] == ledgers[1] == ledgers[2]


def test_projected_adam_matches_adam_on_unprojected_parameters():
    torch.manual_seed(0)
    model = Net()
    engine = PerExampleEngine(model, mlp_loss)
    proj = RandomProjection.on(engine, R, every=10, seed=0)
    head = [p for n, p in model.named_parameters() if n.startswith("head")]
    twin = [p.detach().clone().requires_grad_() for p in head]
    adam = torch.optim.Adam(twin, lr=0.01, eps=1e-12)
    update = ProjectedAdam(engine.params, proj, 0.01, eps=1e-12)
    for _ in range(5):
        grads = [torch.randn(s) for s in engine.shapes]
        update.apply(grads)
        for t, g in zip(twin, grads[-2:]):
            t.grad = g
        adam.step()
    for a, b in zip(head, twin):
        assert torch.allclose(a, b, atol=1e-5)


def test_galore_projection_is_the_top_singular_subspace_of_the_private_gradient():
    engine = PerExampleEngine(Net(), mlp_loss)
    proj = SVDProjection.on(engine, R, every=2)
    grads = [torch.randn(p.shape) for p in engine.params]
    proj(grads)
    for i, side in proj.sides.items():
        p = proj.matrix(i)
        assert torch.allclose(p.T @ p, torch.eye(R), atol=1e-5)
        u, s, vh = torch.linalg.svd(grads[i])
        basis = u[:, :R] if side == "left" else vh[:R].T
        assert torch.allclose(basis @ basis.T, p @ p.T, atol=1e-4)


def test_resume_round_trip():
    model, data = Net(), (torch.randn(40, 3, 12), torch.randint(0, 3, (40,)))
    opt = build_algorithm("dp-grape", PerExampleEngine(model, mlp_loss), privatizer(1.0, 1.0),
                          Projection(lr=0.01, rank=R, subspace_every=2))
    for _ in range(3):
        opt.step(data)
    state = copy.deepcopy(opt.state_dict())
    twin = Net()
    twin.load_state_dict(model.state_dict())
    opt2 = build_algorithm("dp-grape", PerExampleEngine(twin, mlp_loss), privatizer(1.0, 1.0),
                           Projection(lr=0.01, rank=R, subspace_every=2))
    opt2.load_state_dict(state)
    opt.step(data)
    opt2.step(data)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


@pytest.mark.parametrize("rank,every,message", [(0, 10, "rank"), (4, 0, "every"), (64, 10, "nothing to project")])
def test_bad_parameters(rank, every, message):
    with pytest.raises(ValueError, match=message):
        RandomProjection.on(PerExampleEngine(Net(), mlp_loss), rank, every, seed=0)


def test_frozen_weights_are_not_projected_and_the_refusal_says_to_train_them():
    """Only trained weights are projected: a model whose projectable weights are all frozen (a pretrained
    model's head trained alone) is refused, naming --trainable."""
    model = Net()
    RandomProjection.on(PerExampleEngine(model, mlp_loss), 4, 10, seed=0)  # projectable while trained
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("head"))
    with pytest.raises(ValueError, match=r"nothing to project.*--trainable"):
        RandomProjection.on(PerExampleEngine(model, mlp_loss), 4, 10, seed=0)


def full_batch_privatizer(n):
    """Every example every step, no clipping in effect and no noise: the private step reduces to the
    mean gradient."""
    return Privatizer(Clipping(1e6), GaussianNoise(0.0, 1e6, SecretStream(0, "noise")),
                      FixedOrderSampler(n, n, SecretStream(0, "sampling")), PrivacyLedger())


def test_without_clipping_and_noise_dp_grape_is_projected_adam_on_the_batch_gradient():
    """The projected book-keeping sum equals P^T (sum of full per-example gradients): DP-GRAPE at C = inf,
    sigma = 0 is Adam with random projected moments on the autograd batch gradient, across a refresh."""
    model, data = Net(), (torch.randn(16, 3, 12), torch.randint(0, 3, (16,)))
    twin = copy.deepcopy(model)
    hp = Projection(lr=0.01, rank=R, subspace_every=2, projection_seed=3)
    opt = build_algorithm("dp-grape", PerExampleEngine(model, mlp_loss), full_batch_privatizer(16), hp)
    proj = RandomProjection.on(PerExampleEngine(twin, mlp_loss), R, 2, seed=3)
    ref = ProjectedAdam(list(twin.parameters()), proj, 0.01, eps=hp.eps)
    for _ in range(3):
        opt.step(data)
        twin.zero_grad()
        mlp_loss(twin, data).mean().backward()
        ref.apply([p.grad for p in twin.parameters()])
        proj.after_update([])
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_without_clipping_and_noise_naive_dp_galore_is_galore():
    model, data = Net(), (torch.randn(16, 3, 12), torch.randint(0, 3, (16,)))
    twin = copy.deepcopy(model)
    hp = Projection(lr=0.01, rank=R, subspace_every=2)
    opt = build_algorithm("dp-galore", PerExampleEngine(model, mlp_loss), full_batch_privatizer(16), hp)
    galore = GaLore(twin, R, every=2, lr=0.01, eps=hp.eps)
    assert galore.projection.sides == opt.transforms[0].sides
    for _ in range(3):
        opt.step(data)
        mlp_loss(twin, data).mean().backward()
        galore.step()
        galore.zero_grad()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("reset", [False, True])
def test_moments_carry_over_a_refresh_unless_reset(reset):
    engine = PerExampleEngine(Net(), mlp_loss)
    engine.projection = proj = RandomProjection.on(engine, R, every=2, seed=0)
    update = ProjectedAdam(engine.params, proj, 0.01, reset_on_refresh=reset)
    i = sorted(proj.sides)[0]
    for _ in range(3):  # steps 0, 1 in the first subspace; step 2 starts the second
        grads = [torch.randn(s) for s in engine.shapes]
        update.apply(grads)
        proj.after_update([])
    fresh = 0.1 * grads[i]  # (1 - beta1) * g: a moment started at this step
    assert torch.allclose(update.moments[i][0], fresh) == reset
    assert not torch.allclose(update.moments[-1][0], 0.1 * grads[-1])  # unprojected moments are never reset


@pytest.mark.parametrize("name", ["bert", "roberta", "opt", "vit"])
def test_stock_hf_models_project_attention_and_mlp_weights_only(name):
    pytest.importorskip("transformers")
    from test_hf_models import build

    model, loss, _ = build(name)
    engine = PerExampleEngine(model, loss)
    names = {engine.names[i] for i in RandomProjection.on(engine, 8, 10, seed=0).sides}
    blocks = [n for n in names if ".layer." in n or ".layers." in n]
    assert len(blocks) == 2 * 6  # q, k, v, attention output, MLP in and out in each of the 2 blocks
    assert names - set(blocks) <= {"bert.pooler.dense.weight"}
    assert not any(part in n for n in names for part in ("embed", "classifier", "lm_head", "bias", "norm"))


def test_cli_trains_dp_grape(capsys):
    from dpopt.cli import main

    assert main(["train", "--algorithm", "dp-grape", "--rank", "4", "--subspace-every", "5", "--lr", "0.01",
                 "--epochs", "2", "--reset-moments", "--projection-exclude", "head", "--no-progress"]) == 0
    assert "test accuracy" in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [
    (["--rank", "0"], "projection rank must be >= 1"),
    (["--subspace-every", "0"], "refreshed every >= 1 steps"),
    (["--rank", "64"], "nothing to project"),
])
def test_cli_bad_projection_parameters(args, message, capsys):
    from dpopt.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--algorithm", "dp-grape", "--epochs", "1", "--no-progress", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err
