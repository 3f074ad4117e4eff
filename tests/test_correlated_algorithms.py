"""DP-FTRL, DP-MEMF, DP-SRG-MEMF and Accelerated-DP-SRGD: reductions, hand-written recursions, oracle
counts, DiSK on correlated noise, and the trainer/CLI (metrics, resume, refused combinations)."""

import dataclasses
import json
import warnings

import pytest
import torch
from torch import nn

from dpopt import make_private
from dpopt.algorithms import CONFIGS, SGD, SRGD, Privatizer, StepRule, applies_to, build_algorithm, hyperparameters_for
from dpopt.cli import main
from dpopt.clipping import Clipping
from dpopt.data.samplers import FixedOrderSampler
from dpopt.grad import PerExampleEngine
from dpopt.noise import SecretStream, build_noise
from dpopt.privacy import AccountingError, PrivacyLedger
from dpopt.run import TrainConfig, build_run, resume, train
from dpopt.transforms import AcceleratedSRG, KalmanFilter, RecursiveGradient
from helpers import mlp_loss, quiet, train_keeping_epoch_one

N, BATCH, EPOCHS = 24, 8, 2


def problem(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    return model, (torch.randn(N, 5), torch.randint(0, 3, (N,)))


def optimizer(model, algorithm, noise="mf", z=1.0, clip=1.0, batch=BATCH, **hp):
    sampler = FixedOrderSampler(N, batch, SecretStream(3, "sampling"))
    horizon = EPOCHS * sampler.steps_per_epoch
    mech = build_noise(noise, z, clip, SecretStream(3, "noise"), horizon, sampler.steps_per_epoch,
                       momentum=hp.get("momentum", 0.0))
    privatizer = Privatizer(Clipping(clip), mech, sampler, PrivacyLedger())
    return build_algorithm(algorithm, PerExampleEngine(model, mlp_loss), privatizer, CONFIGS[algorithm](**hp))


def lr_of(dp):
    """The step a private optimizer's update uses: a torch optimizer's, or Accelerated-DP-SRGD's 1/beta."""
    return dp.base.lr if hasattr(dp.base, "lr") else dp.base.param_groups[0]["lr"]


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def full_grad(model, data, at=None):
    """Mean gradient of the whole data at `at` (default: the model's parameters)."""
    saved = params(model)
    if at is not None:
        with torch.no_grad():
            for p, a in zip(model.parameters(), at):
                p.copy_(a)
    model.zero_grad()
    mlp_loss(model, data).mean().backward()
    g = [p.grad.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p, s in zip(model.parameters(), saved):
            p.copy_(s)
    return g


def test_srg_memf_with_decay_zero_is_exactly_dp_memf():
    """H8 (spec §3.8): Alg. 3 with c = 0 equals Alg. 2 — same noise, same batches, identical iterates; the
    noise enters once (Alg. 3 line 7 uses the running sum, not the running sum plus noise again)."""
    runs = []
    for algorithm in ("dp-memf", "dp-srg-memf"):
        model, data = problem()
        opt = optimizer(model, algorithm, lr=0.2, momentum=0.9, **({"decay": 0.0} if algorithm == "dp-srg-memf" else {}))
        for _ in range(EPOCHS * 3):
            opt.step(data)
        runs.append((params(model), opt.privatizer.ledger.entries))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
    assert runs[0][1] == runs[1][1]


def test_srg_memf_without_noise_is_the_srg_recursion():
    """z = 0, clipping inactive, the full data each step: ∇_t = c ∇_{t-1} + g(x_t) − c g(x_{t-1}) feeds
    momentum SGD, with the difference taken on the same data at both iterates."""
    c, lr, mu = 0.3, 0.1, 0.5
    model, data = problem()
    opt = optimizer(model, "dp-srg-memf", z=0.0, clip=1e6, batch=N, lr=lr, momentum=mu, decay=c)
    ref, _ = problem()
    x = params(ref)
    x_prev = grad = buf = None
    for _ in range(EPOCHS):
        opt.step(data)
        g = full_grad(ref, data, x)
        delta = g if x_prev is None else [a - c * b for a, b in zip(g, full_grad(ref, data, x_prev))]
        grad = delta if grad is None else [c * r + d for r, d in zip(grad, delta)]
        buf = [r.clone() for r in grad] if buf is None else [mu * b + r for b, r in zip(buf, grad)]
        x_prev, x = x, [a - lr * b for a, b in zip(x, buf)]
    for a, b in zip(params(model), x):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("algorithm", ["accel-dp-srgd", "dp-srgd"])
def test_accelerated_srgd_without_noise_is_nesterov_on_the_srg_estimate(algorithm):
    """Alg. 1 written with line 4's recursive form ∇_t = Δ_t/η_t + (η_{t-1}/η_t) ∇_{t-1} and explicit
    y/z/x sequences (τ ≡ 0 for the unaccelerated variant), projections active; the model holds y."""
    lr, radius = 0.5, 0.3
    accelerate = algorithm == "accel-dp-srgd"
    model, data = problem()
    opt = optimizer(model, algorithm, noise="tree", z=0.0, clip=1e6, batch=N, lr=lr, radius=radius)
    ref, _ = problem()
    center = params(ref)

    def project(v):
        dist = torch.sqrt(sum(((a - c) ** 2).sum() for a, c in zip(v, center)))
        return v if dist <= radius else [c + (a - c) * radius / dist for a, c in zip(v, center)]

    x, z = params(ref), params(ref)
    x_prev, grad = None, None
    for t in range(EPOCHS):
        opt.step(data)
        eta = t + 1.0
        g = full_grad(ref, data, x)
        delta = [eta * a for a in g] if x_prev is None else [
            eta * a - (eta - 1) * b for a, b in zip(g, full_grad(ref, data, x_prev))]
        grad = [d / eta for d in delta] if grad is None else [d / eta + (eta - 1) / eta * r
                                                              for d, r in zip(delta, grad)]
        z = project([a - lr * eta * r for a, r in zip(z, grad)])
        y = project([a - lr * r for a, r in zip(x, grad)])
        tau = 2.0 / (t + 3) if accelerate else 0.0
        x_prev, x = x, [(1 - tau) * a + tau * b for a, b in zip(y, z)]
        for a, b in zip(params(model), y):
            assert torch.allclose(a, b, atol=1e-5)


def _at_equal_points(name, params):
    """A two-point statistic whose second point equals the first, and what it then reduces to (a multiple
    of the gradient at one point, on one sample ξ_i)."""
    if name == "srg":
        srg = RecursiveGradient(0.75)
        srg.previous = [p.detach().clone() for p in params]
        return srg.statistic, 0.25
    if name == "nesterov":
        coupling = AcceleratedSRG(params, lr=0.1)
        coupling.t, coupling.x_prev = 5, [p.detach().clone() for p in params]  # η_t = 6, η_{t-1} = 5
        return coupling.statistic, 1.0
    kalman = KalmanFilter(kappa=0.7, gamma=0.5)  # c = 6/7: both points evaluated
    kalman.delta = [torch.zeros_like(p) for p in params]
    return kalman.statistic, 1.0


@pytest.mark.parametrize("name", ["srg", "nesterov", "kalman"])
def test_two_point_statistics_see_one_dropout_mask_at_both_points(name):
    """Line 3 of Alg. 1 (and DiSK's Alg. 3 line 5) evaluates the SAME sample ξ_i at both points: with dropout,
    the same masks. At equal points the statistic is then exactly a multiple of one evaluation; with fresh
    masks at the second point it would carry their difference (times η_t for the accelerated one)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 3))
    data = (torch.randn(N, 5), torch.randint(0, 3, (N,)))
    engine = PerExampleEngine(model, mlp_loss)
    statistic, factor = _at_equal_points(name, engine.params)
    flat = lambda g: torch.cat([t.flatten(1) for t in g.materialize()], 1)  # noqa: E731
    state = torch.random.get_rng_state()
    once = flat(engine.gradients(data))
    assert not torch.allclose(once, flat(engine.gradients(data)))  # the masks do differ per call
    torch.random.set_rng_state(state)
    assert torch.allclose(flat(statistic(engine, data)), factor * once, atol=1e-6)


def test_accelerated_srgd_uses_two_gradient_evaluations_per_example(monkeypatch):
    """H4: exactly two per-example gradient evaluations per example (one at step 0), each on the batch."""
    model, data = problem()
    opt = optimizer(model, "accel-dp-srgd", noise="tree", lr=0.1)
    opt.verified = True  # skip the engine's one-off self-check, which evaluates a few examples
    calls = []
    original = PerExampleEngine.gradients

    def counting(self, batch, at=None):
        calls.append(len(batch[1]))
        return original(self, batch, at)

    monkeypatch.setattr(PerExampleEngine, "gradients", counting)
    steps = EPOCHS * 3
    for _ in range(steps):
        opt.step(data)
    assert calls == [BATCH] + [BATCH] * 2 * (steps - 1)


def test_disk_runs_on_correlated_noise_at_the_base_methods_privacy_cost():
    ledgers = []
    for algorithm in ("dp-sgd", "disk-sgd"):
        model, data = problem()
        opt = optimizer(model, algorithm, noise="tree", lr=0.1)
        for _ in range(EPOCHS * 3):
            opt.step(data)
        ledgers.append(opt.privatizer.ledger)
    assert ledgers[0].entries == ledgers[1].entries
    assert ledgers[0].entries[0].factorization == "tree-sum"
    assert ledgers[0].epsilon(1e-5) == ledgers[1].epsilon(1e-5)


# --- trainer and CLI ------------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm,sampling,noise,mechanism", [
    ("dp-ftrl", "fixed", "tree", "correlated-gaussian"), ("accel-dp-srgd", "fixed", "tree", "correlated-gaussian"),
    ("dp-srgd", "fixed", "tree", "correlated-gaussian"), ("dp-ftrl", "auto", "banded", "gaussian"),
    ("dp-memf", "auto", "banded", "gaussian"), ("dp-srg-memf", "auto", "banded", "gaussian"),  # amplified BandMF
    ("accel-dp-srgd", "auto", "banded", "gaussian"), ("dp-srgd", "auto", "banded", "gaussian"),
    ("dp-memf", "fixed", "mf", "correlated-gaussian")])
def test_cli_trains_each_correlated_algorithm(algorithm, sampling, noise, mechanism, tmp_path):
    momentum = ["--momentum", "0.5"] if algorithm in applies_to("momentum") else []
    assert main(["train", "--algorithm", algorithm, "--epochs", "1", "--batch-size", "256", "--lr", "0.5", *momentum,
                 "--workload", "true",
                 "--sampling", sampling, "--no-progress", "--out", str(tmp_path)]) == 0
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["sampling"] == ("cyclic" if noise == "banded" else "fixed") and m["noise"] == noise
    assert 0.995 * 2.0 <= m["epsilon"] <= 2.0 and m["test_accuracy"] > 0.3
    assert m["ledger"]["entries"][0]["mechanism"] == mechanism


@pytest.mark.parametrize("noise,algorithm,sampling", [("tree", "dp-srg-memf", "auto"), ("banded", "disk-sgd", "auto"),
                                                       ("banded", "dp-memf", "cyclic")])  # amplified BandMF
def test_resume_reproduces_a_correlated_run(tmp_path, noise, algorithm, sampling):
    config = TrainConfig(algorithm=algorithm, noise=noise, epochs=2, batch_size=512, epsilon=2.0, sampling=sampling,
                         tree_decoder="least-squares" if noise == "tree" else None, bands=2 if noise != "tree" else 0,
                         hyperparameters=CONFIGS[algorithm](lr=0.5, momentum=0.5))
    full = train_keeping_epoch_one(config, tmp_path / "full", tmp_path / "cut")  # its own OS-entropy key
    resumed = resume(tmp_path / "cut", progress=False, log=lambda _: None)
    a = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["ledger"] == full["ledger"] and resumed["epsilon"] == full["epsilon"]
    assert full["history"][0]["epsilon"] < full["history"][-1]["epsilon"]  # epsilon of each prefix


@pytest.mark.parametrize("overrides,error,message", [
    (dict(algorithm="dp-ftrl", sampling="poisson"), AccountingError, "Poisson"),
    (dict(algorithm="dp-memf", sampling="shuffle"), AccountingError, "same position"),
    (dict(noise="tree", sampling="shuffle", epochs=2), AccountingError, "same position"),
    (dict(algorithm="dp-memf", noise="banded", bands=50), ValueError, "bands <= steps"),
])
def test_mismatched_sampling_and_noise_are_refused(overrides, error, message):
    config = TrainConfig(**{"epochs": 2, "batch_size": 256, "epsilon": 2.0, **overrides})
    with pytest.raises(error, match=message):
        train(config, progress=False, log=lambda _: None)


@pytest.mark.parametrize("args,message", [
    (["--algorithm", "dp-srg-memf", "--decay", "1"], "decay c must lie in [0, 1)"),
    (["--workload", "momentum"], "argument --workload: invalid choice 'momentum' (choose from ones, true)"),
    (["--tree-decoder", "mean"], "argument --tree-decoder: invalid choice 'mean' (choose from sum, least-squares)"),
    (["--algorithm", "dp-srgd", "--radius", "-1"], "constraint radius"),
    (["--bands", "-1"], "bands must be >= 0"),
    (["--algorithm", "dp-ftrl", "--sampling", "poisson"], "no privacy analysis with Poisson"),
])
def test_bad_correlated_input_gets_a_clear_error(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--epochs", "1", "--no-progress", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_accelerated_srgd_warns_when_its_step_is_too_large_for_the_run_length():
    """Claim 4.2: the step 1/beta must shrink like 1/T; a fixed lr 0.01 over 9,380 MNIST steps gave 45.6%
    (1.1 / T: 89.5%). The hint fires for lr * T above 4 * 1.1, not at twice the default product."""
    model, _ = problem()
    steps = EPOCHS * (N // BATCH)
    with pytest.warns(UserWarning, match="likely too large"):
        optimizer(model, "accel-dp-srgd", noise="tree", lr=10.0 / steps)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer(model, "accel-dp-srgd", noise="tree", lr=2.2 / steps)
        optimizer(model, "dp-srgd", noise="tree", lr=10.0 / steps)  # unaccelerated: no 1/T bound (3.1 / sqrt(T))


@pytest.mark.parametrize("algorithm", ["accel-dp-srgd", "dp-srgd"])
def test_a_statistic_scale_s_is_a_clip_s_times_larger_with_a_step_s_times_smaller(algorithm):
    """Dividing the two-point statistic by s before a clip at C, at step lr, moves the model as clipping it at s*C,
    at step lr / s, with the same noise draws (whose std is then s times larger, in units of the statistic): the same
    iterates up to rounding, with both clips binding on some examples; s = 1 is the paper's statistic."""
    runs = []
    for clip, lr, scale in ((0.5, 0.02, 4.0), (2.0, 0.005, 1.0)):
        model, data = problem()
        opt = optimizer(model, algorithm, noise="tree", z=0.5, clip=clip, lr=lr, statistic_scale=scale)
        clipped = [opt.step(data).clipped for _ in range(EPOCHS * 3)]
        runs.append(params(model))
    assert 0 < sum(clipped) < len(clipped) * BATCH  # the clip cut some examples, not all
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="statistic scale must be a finite number > 0"):
        SRGD(statistic_scale=0.0)


def test_accel_dp_srgd_scales_its_statistic_by_the_run_length_past_938_steps():
    """accel-dp-srgd's default scale is max(1, T / 938), resolved with the run's length (read back from a config as
    a rule); 1 on digits' default run, and a given scale is kept."""
    config = TrainConfig(algorithm="accel-dp-srgd", noise_multiplier=1.0, sampling="fixed")  # 12 steps an epoch
    rule = config.hyperparameters.statistic_scale
    assert isinstance(rule, StepRule) and TrainConfig.from_dict(config.to_dict()).hyperparameters.statistic_scale == rule
    for epochs, scale in ((20, 1.0), (90, 1080 / 938)):
        run = build_run(dataclasses.replace(config, epochs=epochs), log=quiet)
        assert run.total_steps == 12 * epochs
        assert run.config.hyperparameters.statistic_scale == run.optimizer.base.scale == scale
    given = hyperparameters_for("accel-dp-srgd", statistic_scale=3.0)
    run = build_run(dataclasses.replace(config, epochs=90, hyperparameters=given), log=quiet)
    assert run.optimizer.base.scale == 3.0


@pytest.mark.parametrize("algorithm,rule", [("accel-dp-srgd", StepRule(1.1 * 240 ** 0.5, 1.5, cap=StepRule(1.1, 1.0))),
                                            ("dp-ftrl", StepRule(0.465, 0.5, floor=0.03)),
                                            ("dp-srgd", StepRule(3.1, 0.5, cap=0.2, floor=0.1)),
                                            ("dp-adam", StepRule(0.15, 0.5))])
def test_a_default_step_set_by_the_run_length_is_resolved_once_the_length_is_known(algorithm, rule):
    """accel-dp-srgd's default lr is min(1.1 / T, 1.1 sqrt(240) / T^1.5), DP-FTRL's max(0.03, 0.465 / sqrt(T)),
    DP-SRGD's max(0.1, min(0.2, 3.1 / sqrt(T))) and Adam's 0.15 / sqrt(T) for the run's T steps, resolved once the
    run's length is known (train's config and make_private alike); a given lr is kept; an unresolved rule or no lr at
    all is refused."""
    assert TrainConfig(algorithm=algorithm).hyperparameters.lr == rule
    for epochs in (1, 90):  # 12 and 1,080 steps: the caps bind on the first only, the floors on the second
        run = build_run(TrainConfig(algorithm=algorithm, epochs=epochs, noise_multiplier=1.0), log=quiet)
        lr = rule.scale / run.total_steps ** rule.power
        cap = rule.cap(run.total_steps) if isinstance(rule.cap, StepRule) else rule.cap
        floor = rule.floor or 0.0
        assert run.config.hyperparameters.lr == lr_of(run.optimizer) == max(floor, lr if cap is None else min(cap, lr))
        if cap is not None:  # the run-length term takes over on the longer run only
            assert (lr < cap) == (epochs == 90)
        if rule.floor is not None:  # and the floor on the longer run only
            assert (lr < floor) == (epochs == 90)
    assert TrainConfig.from_dict(TrainConfig(algorithm=algorithm).to_dict()).hyperparameters.lr == rule  # the rule read back
    given = TrainConfig(algorithm=algorithm, noise_multiplier=1.0, hyperparameters=CONFIGS[algorithm](lr=0.003))
    assert lr_of(build_run(given, log=quiet).optimizer) == 0.003
    model, (x, y) = problem()
    _, opt, _ = make_private(model, None, (x, y), mlp_loss, algorithm=algorithm, batch_size=BATCH, epochs=2,
                             noise_multiplier=1.0)
    assert lr_of(opt.dp) == rule(2 * N // BATCH)
    with pytest.raises(ValueError, match="learning rate must be a finite number > 0, got None"):
        SGD(lr=None)
    with pytest.raises(ValueError, match="still the rule"):
        optimizer(problem()[0], algorithm, noise="tree" if algorithm != "dp-adam" else "gaussian", lr=rule)
