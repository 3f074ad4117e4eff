"""DiSK: reductions (kappa = 1 is the base; STORM; NAG-type look-ahead), one release per step, joint clipping."""

import copy

import pytest
import torch
from torch import nn

from dpopt.algorithms import CONFIGS, DiSKSGD, Privatizer, build_algorithm
from dpopt.clipping import Clipping, clip_and_sum
from dpopt.data.samplers import PoissonSampler, ShuffleSampler
from dpopt.grad import PerExampleEngine
from dpopt.noise.gaussian import GaussianNoise
from dpopt.noise.rng import SecretStream
from dpopt.privacy import PrivacyLedger
from dpopt.transforms import KalmanFilter
from helpers import mlp_loss

N = 24


def problem(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    data = (torch.randn(N, 5), torch.randint(0, 3, (N,)))
    return model, data


def optimizer(model, algorithm, z=1.0, clip=1.0, sampler=None, **hp):
    engine = PerExampleEngine(model, mlp_loss)
    sampler = sampler or PoissonSampler(N, 0.5, SecretStream(3, "sampling"))
    privatizer = Privatizer(Clipping(clip), GaussianNoise(z, clip, SecretStream(3, "noise")), sampler, PrivacyLedger())
    config = CONFIGS[algorithm]  # a base recipe ignores DiSK's settings (kappa, gamma) given to compare with it
    return build_algorithm(algorithm, engine, privatizer, config(**{k: v for k, v in hp.items()
                                                                   if k in config.__dataclass_fields__}))


def params(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("base,lr", [("sgd", 0.1), ("adam", 0.01), ("adamw", 0.01)])
def test_kappa_one_is_exactly_the_base(base, lr):
    runs = []
    for algorithm in (f"dp-{base}", f"disk-{base}"):
        model, data = problem()
        opt = optimizer(model, algorithm, lr=lr, kappa=1.0, weight_decay=0.01)
        for _ in range(6):
            opt.step(data)
        runs.append((params(model), opt.privatizer.ledger.entries))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
    assert runs[0][1] == runs[1][1]


@pytest.mark.parametrize("adam", ["dp-adam", "disk-adam"])
def test_adamw_at_weight_decay_zero_is_exactly_adam(adam):
    """Their defaults (weight decay 0) make dp-adamw dp-adam and disk-adamw disk-adam, step for step: one run
    of each pair stands for the other (docs/defaults.md, the ViT's disk-adam cell)."""
    runs = []
    for algorithm in (adam, adam + "w"):
        model, data = problem()
        opt = optimizer(model, algorithm, lr=0.01, weight_decay=0.0)
        for _ in range(6):
            opt.step(data)
        runs.append(params(model))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert not all(torch.equal(a, b) for a, b in zip(runs[0], params(problem()[0])))  # it moved


def test_same_privacy_cost_as_the_base():
    ledgers = []
    for algorithm in ("dp-adam", "disk-adam"):
        model, data = problem()
        opt = optimizer(model, algorithm, lr=0.01)
        for _ in range(5):
            opt.step(data)
        ledgers.append(opt.privatizer.ledger)
    assert ledgers[0].entries == ledgers[1].entries
    assert ledgers[0].epsilon(1e-5) == ledgers[1].epsilon(1e-5)


def full_batch_grad(model, data):
    model.zero_grad()
    mlp_loss(model, data).mean().backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def noiseless(model, algorithm, batch=N, **hp):
    """No noise, clipping never active, fixed-size batches (the whole dataset by default): DiSK's
    optimisation recursion alone."""
    sampler = ShuffleSampler(N, batch, SecretStream(0, "sampling"))
    return optimizer(model, algorithm, z=0.0, clip=1e6, sampler=sampler, **hp)


def test_gamma_minus_one_is_storm():
    """gamma = -1, SGD: g~_t = (1-k) g~_{t-1} + k grad(x_t) + (1-k)(grad(x_t) - grad(x_{t-1})), both gradients
    on the same minibatch xi_t (shuffled batches of 6)."""
    kappa, lr = 0.3, 0.2
    model, data = problem()
    opt = noiseless(model, "disk-sgd", batch=6, lr=lr, kappa=kappa, gamma=-1.0)
    ref, _ = problem()
    g_tilde, prev = None, None
    for step in range(6):
        opt.step(data)
        idx = opt.privatizer.sampler.batch(step)
        xi = (data[0][idx], data[1][idx])
        g = full_batch_grad(ref, xi)
        if g_tilde is None:
            g_tilde = g
        else:
            now = params(ref)
            with torch.no_grad():
                for p, q in zip(ref.parameters(), prev):
                    p.copy_(q)
            g_prev = full_batch_grad(ref, xi)
            with torch.no_grad():
                for p, q in zip(ref.parameters(), now):
                    p.copy_(q)
            g_tilde = [(1 - kappa) * t + kappa * a + (1 - kappa) * (a - b) for t, a, b in zip(g_tilde, g, g_prev)]
        prev = params(ref)
        with torch.no_grad():
            for p, t in zip(ref.parameters(), g_tilde):
                p -= lr * t
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_gamma_at_c_one_is_a_look_ahead_momentum_with_one_evaluation():
    """gamma = (1-k)/k, SGD with lr = k (spec's corrected NAG link): g~_t = mu g~_{t-1} + k grad(x_t - mu g~_{t-1}),
    mu = 1 - k, x_{t+1} = x_t - k g~_t; and one gradient evaluation per step."""
    kappa = 0.6
    mu = 1 - kappa
    model, data = problem()
    opt = noiseless(model, "disk-sgd", lr=kappa, kappa=kappa, gamma=(1 - kappa) / kappa)
    opt.verified = True  # count the statistic's evaluations only, not the one-time self-check
    calls = []
    original = opt.engine.gradients
    opt.engine.gradients = lambda *a, **k: calls.append(1) or original(*a, **k)
    ref, _ = problem()
    g_tilde = None
    for step in range(5):
        opt.step(data)
        if g_tilde is None:
            g_tilde = full_batch_grad(ref, data)
        else:
            now = params(ref)
            with torch.no_grad():
                for p, t in zip(ref.parameters(), g_tilde):
                    p -= mu * t
            look = full_batch_grad(ref, data)
            with torch.no_grad():
                for p, q in zip(ref.parameters(), now):
                    p.copy_(q)
            g_tilde = [mu * t + kappa * a for t, a in zip(g_tilde, look)]
        with torch.no_grad():
            for p, t in zip(ref.parameters(), g_tilde):
                p -= kappa * t
    assert len(calls) == 5
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("kappa,gamma", [(0.7, 0.5), (0.7, 0.2), (0.5, 2.0), (0.7, -0.5)])
def test_the_mixture_is_clipped_as_one_vector(kappa, gamma):
    """Removing one example moves the clipped sum of the mixture by at most C, for c in and outside [0, 1]."""
    model, data = problem()
    engine = PerExampleEngine(model, mlp_loss)
    kf = KalmanFilter(kappa, gamma)
    kf.delta = [0.5 * torch.randn_like(p) for p in engine.params]
    clip = Clipping(1e-3)
    full, _ = clip_and_sum(kf.statistic(engine, data), clip)
    for i in range(0, N, 5):
        keep = torch.tensor([j for j in range(N) if j != i])
        part, _ = clip_and_sum(kf.statistic(engine, (data[0][keep], data[1][keep])), clip)
        change = torch.stack([(a - b).square().sum() for a, b in zip(full, part)]).sum().sqrt()
        assert change <= 1e-3 * (1 + 1e-5)


def test_first_step_releases_once_and_starts_the_filter_at_g0():
    model, data = problem()
    opt = optimizer(model, "disk-sgd", lr=0.1)
    opt.step(data)
    kf = opt.transforms[0]
    assert opt.privatizer.ledger.steps == 1
    before = params(model)
    # g~_0 = g_0: the first update is exactly -lr * g~_0
    assert kf.delta is not None
    assert all(torch.allclose(d, -0.1 * f) for d, f in zip(kf.delta, kf.filtered))
    opt.step(data)
    assert all(torch.allclose(d, p.detach() - b) for d, p, b in zip(kf.delta, model.parameters(), before))


def test_delta_is_the_measured_change_under_adamw():
    model, data = problem()
    opt = optimizer(model, "disk-adamw", lr=0.05, weight_decay=0.1)
    for _ in range(3):
        before = params(model)
        opt.step(data)
        for d, p, b in zip(opt.transforms[0].delta, model.parameters(), before):
            assert torch.allclose(d, p.detach() - b)


@pytest.mark.parametrize("kappa,gamma,message", [(0.0, 0.5, "kappa"), (1.5, 0.5, "kappa"), (0.7, 0.0, "gamma")])
def test_bad_parameters(kappa, gamma, message):
    with pytest.raises(ValueError, match=message):
        KalmanFilter(kappa, gamma)


def test_resume_state_round_trip():
    model, data = problem()
    opt = optimizer(model, "disk-adam", lr=0.01)
    for _ in range(3):
        opt.step(data)
    state = copy.deepcopy(opt.state_dict())  # as a checkpoint file would hand it back
    model2, _ = problem()
    model2.load_state_dict(model.state_dict())
    opt2 = optimizer(model2, "disk-adam", lr=0.01)
    opt2.load_state_dict(state)
    opt.step(data)
    opt2.step(data)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def grape_problem():
    from test_grape import Net

    torch.manual_seed(0)
    return Net(), (torch.randn(N, 3, 12), torch.randint(0, 3, (N,)))


@pytest.mark.parametrize("kappa", [1.0, 0.7])
def test_disk_composes_with_dp_grape(kappa):
    """disk-grape = DiSK on DP-GRAPE's projected Adam: kappa = 1 is dp-grape exactly, and the ledger is
    dp-grape's for any kappa."""
    runs = []
    for algorithm in ("dp-grape", "disk-grape"):
        model, data = grape_problem()
        opt = optimizer(model, algorithm, lr=0.01, rank=4, subspace_every=2, kappa=kappa)
        for _ in range(4):
            opt.step(data)
        runs.append((params(model), opt.privatizer.ledger.entries))
    assert runs[0][1] == runs[1][1]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0])) == (kappa == 1.0)


def test_disk_grape_privatizes_the_projected_mixture_and_filters_in_the_projected_space():
    """Both points are projected by the same public P: the statistic is P^T (c g(x + gamma d) + (1-c) g(x))
    (left; G P on the right), and g~ has the projected shapes while d has the parameters'."""
    model, data = grape_problem()
    opt = optimizer(model, "disk-grape", lr=0.01, rank=4, subspace_every=1, kappa=0.6, gamma=0.3)
    for _ in range(3):  # the subspace changes every step
        opt.step(data)
    kf, engine, proj = opt.transforms[0], opt.engine, opt.engine.projection
    assert [f.shape for f in kf.filtered] == engine.shapes != [p.shape for p in engine.params]
    assert [d.shape for d in kf.delta] == [p.shape for p in engine.params]
    got = kf.statistic(engine, data).materialize()
    ref = PerExampleEngine(model, mlp_loss, "vmap")
    ahead = [p.detach() + kf.gamma * d for p, d in zip(engine.params, kf.delta)]
    mix = [kf.c * a + (1 - kf.c) * b for a, b in zip(ref.gradients(data, at=ahead).materialize(),
                                                       ref.gradients(data).materialize())]
    for i, (g, m) in enumerate(zip(got, mix)):
        if i in proj.sides:
            p = proj.matrix(i)
            m = torch.einsum("mr,bmn->brn", p, m) if proj.sides[i] == "left" else m @ p
        assert torch.allclose(g, m, atol=1e-5, rtol=1e-4), engine.names[i]


def test_disk_refuses_a_base_with_its_own_statistic():
    from dpopt.algorithms.base import PrivateStep
    from dpopt.algorithms.disk import with_kalman

    def two_point(engine, privatizer, hp):
        return PrivateStep(engine, privatizer, torch.optim.SGD(engine.params, lr=hp.lr),
                           statistic=lambda e, b: e.gradients(b) - e.gradients(b))

    model, _ = problem()
    engine = PerExampleEngine(model, mlp_loss)
    privatizer = Privatizer(Clipping(1.0), GaussianNoise(1.0, 1.0, SecretStream(3, "noise")),
                            PoissonSampler(N, 0.5, SecretStream(3, "sampling")), PrivacyLedger())
    with pytest.raises(ValueError, match="its own two-point statistic"):
        with_kalman(two_point)(engine, privatizer, DiSKSGD())


@pytest.mark.parametrize("algorithm", ["disk-adam", "disk-grape"])
def test_cli_trains_disk_with_kappa_and_gamma(tmp_path, algorithm):
    import json

    from dpopt.cli import main

    assert main(["train", "--algorithm", algorithm, "--kappa", "0.6", "--gamma", "1.0", "--lr", "0.01",
                 "--epochs", "1", "--epsilon", "2", "--out", str(tmp_path), "--no-progress"]) == 0
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["config"]["hyperparameters"]["kappa"] == 0.6 and m["config"]["hyperparameters"]["gamma"] == 1.0
    assert m["epsilon"] <= 2.0 and m["test_accuracy"] > 0.3
