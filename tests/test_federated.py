"""Federated Clip-SGD / Clip21-SGD / Clip21-SGD2M (spec clip21_sgd2m.md): update rules against a hand
computation, reductions between the methods, error-feedback invariants, per-client local-DP ledgers,
failure handling, the vectorised oracle, partitions, the CLI and bad input. The Flower engine's test is in
test_federated_flower.py."""

import json
import math
import re

import pytest
import torch
from scipy.stats import norm
from torch import nn

from dpopt.cli import main
from dpopt.data.datasets import load_dataset
from dpopt.federated import config as federated_config
from dpopt.federated.config import FederatedConfig, build_setup, classification_problem, participants
from dpopt.federated.partition import partition
from dpopt.federated.privacy import (LocalNoise, client_ledger, client_stream, ledger_epsilon, noise_std_for,
                                    paper_noise_std)
from dpopt.federated.problem import ModelOracle, Problem
from dpopt.federated.rules import MessageClipping
from dpopt.federated.simulator import ClientFailure, InProcessFederation, run_inprocess
from dpopt.models import build_model
from dpopt.noise.rng import secret_key
from dpopt.privacy import PrivacyLedger
from dpopt.run import accuracy

# ------------------------------------------------------------------------------------------ a tiny problem

A = torch.tensor([[3.0, -1.0], [-2.0, 0.5], [0.5, 2.0]])  # f_i(x) = ||x - a_i||^2 / 2


def quadratic(centres: torch.Tensor, x0: torch.Tensor, wobble: float = 0.0) -> Problem:
    """grad f_i(x) = x - a_i (+ a round-dependent wobble, so successive gradients differ)."""

    def oracle(x, clients, round):
        return torch.stack([x - centres[i] + wobble * math.sin(round + i) for i in clients]) if clients else \
            x.new_zeros(0, x.numel())

    return Problem(oracle, x0.clone(), [x0.numel()], [1] * len(centres), lambda x: {})


def config(**kw) -> FederatedConfig:
    base = dict(clients=3, rounds=4, noise_multiplier=0.0, clip=0.7, lr=0.3, seed=5, eval_every=100)
    return FederatedConfig(**{**base, **kw})


def clip(u: torch.Tensor, tau: float) -> torch.Tensor:
    return u * min(1.0, tau / float(u.norm()))


def by_hand(algorithm: str, beta: float, beta_hat: float, tau: float, lr: float, std: float, rounds: int,
            seed: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Alg. 1 / 2 / 3 written out from the spec, client by client, with the clients' own noise draws."""
    n, d = A.shape
    x, g = torch.zeros(d), torch.zeros(d)
    v, gi = [torch.zeros(d) for _ in range(n)], [torch.zeros(d) for _ in range(n)]
    for t in range(1, rounds + 1):
        cs = []
        for i in range(n):
            grad = x - A[i] + 0.2 * math.sin(t + i)
            omega = std * client_stream(seed, i, "noise").normals([torch.Size([d])], t)[0]
            if algorithm == "clip-sgd":
                cs.append(clip(grad, tau) + omega)
                continue
            v[i] = (1 - beta) * v[i] + beta * grad
            delta = clip(v[i] - gi[i], tau)
            cs.append(delta + omega)
            gi[i] = gi[i] + beta_hat * delta  # no noise in the shift
        g = sum(cs) / n if algorithm == "clip-sgd" else g + beta_hat * sum(cs) / n
        x = x - lr * g
    return x, g, gi


@pytest.mark.parametrize("algorithm,beta,beta_hat,std", [
    ("clip-sgd", 1.0, 1.0, 0.0), ("clip-sgd", 1.0, 1.0, 0.3), ("clip21-sgd", 1.0, 1.0, 0.3),
    ("clip21-sgd2m", 0.4, 0.6, 0.0), ("clip21-sgd2m", 0.4, 0.6, 0.3)])
def test_updates_match_a_hand_computation(algorithm, beta, beta_hat, std):
    kw = {} if algorithm != "clip21-sgd2m" else dict(beta=beta, beta_hat=beta_hat)
    setup = build_setup(config(algorithm=algorithm, noise_multiplier=std / 0.7, **kw),
                        quadratic(A, torch.zeros(2), wobble=0.2), key=5)  # secret seed 5: replayable noise
    fed = InProcessFederation(setup)
    clipped = 0
    for _ in range(4):
        clipped += fed.step().clipped
    x, g, gi = by_hand(algorithm, beta, beta_hat, 0.7, 0.3, std, 4, seed=5)
    assert clipped > 0  # the radius is active in this problem
    torch.testing.assert_close(fed.server.x, x, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fed.server.g, g, rtol=1e-5, atol=1e-6)
    if algorithm != "clip-sgd":
        torch.testing.assert_close(fed.g, torch.stack(gi), rtol=1e-5, atol=1e-6)


def test_clip21_sgd2m_with_unit_momenta_is_clip21_sgd():
    """Spec §3.5 (1): beta = beta_hat = 1 gives Clip21-SGD exactly, on a real model with mini-batches and noise."""
    kw = dict(dataset="digits", model="logreg", clients=4, rounds=6, noise_multiplier=0.5, clip=0.05, lr=0.5,
              batch_size=8, participation=0.75, eval_every=100)
    a = run_inprocess(build_setup(FederatedConfig(algorithm="clip21-sgd", **kw), key=1), progress=False, log=print)
    b = run_inprocess(build_setup(FederatedConfig(algorithm="clip21-sgd2m", beta=1.0, beta_hat=1.0, **kw), key=1),
                      progress=False, log=print)
    assert torch.equal(a.x, b.x)


def test_without_clipping_the_methods_reduce_to_heavy_ball_and_ema_momentum():
    """Spec §3.5 (2)-(3): tau = inf (here 1e9), no noise."""
    beta_hat = 0.3
    setup = build_setup(config(algorithm="clip21-sgd2m", beta=1.0, beta_hat=beta_hat, clip=1e9),
                        quadratic(A, torch.ones(2), wobble=0.2))
    fed, x, g = InProcessFederation(setup), torch.ones(2), torch.zeros(2)
    for t in range(1, 6):
        fed.step()
        g = (1 - beta_hat) * g + beta_hat * (x - A.mean(0) + 0.2 * torch.tensor([math.sin(t + i) for i in range(3)]).mean())
        x = x - 0.3 * g
        torch.testing.assert_close(fed.server.x, x)
    setup = build_setup(config(algorithm="clip21-sgd2m", beta=0.2, beta_hat=1.0, clip=1e9), quadratic(A, torch.ones(2)))
    fed = InProcessFederation(setup)
    for _ in range(5):
        fed.step()
        torch.testing.assert_close(fed.g, fed.v)  # g_i = v_i
        torch.testing.assert_close(fed.server.g, fed.v.mean(0))  # g = mean v_i: SGD with EMA momentum


def test_example_1_clip_gd_stalls_and_error_feedback_converges():
    """Spec §8.3 / claim C1: f_{1,2} = (x -+ 3)^2 / 2, tau = 1, x0 = 1.5."""
    centres, x0 = torch.tensor([[3.0], [-3.0]], dtype=torch.float64), torch.tensor([1.5], dtype=torch.float64)
    runs = {"clip-sgd": dict(lr=0.1), "clip21-sgd": dict(lr=0.1), "clip21-sgd2m": dict(lr=0.05, beta=0.2, beta_hat=0.5)}
    final = {}
    for algorithm, kw in runs.items():
        setup = build_setup(config(algorithm=algorithm, clients=2, clip=1.0, **kw), quadratic(centres, x0))
        fed = InProcessFederation(setup)
        for _ in range(3000 if algorithm == "clip21-sgd2m" else 1000):
            fed.step()
        final[algorithm] = float(fed.server.x)
    assert final["clip-sgd"] == 1.5
    assert abs(final["clip21-sgd"]) < 1e-12 and abs(final["clip21-sgd2m"]) < 1e-12


# ------------------------------------------------------------------------------- invariants and failures


def test_error_feedback_invariants_hold_through_failures():
    """eq. 16: g - mean_i g_i = beta_hat * sum over rounds of (1/n) sum of the delivered noises; the server
    direction equals mean g_i without noise; messages have norm <= tau before the noise."""
    lost = {(2, 1), (4, 3)}
    for std in (0.0, 0.4):
        setup = build_setup(FederatedConfig(dataset="digits", model="logreg", clients=4, rounds=6, clip=0.05, lr=0.5,
                                            beta=0.5, beta_hat=0.5, batch_size=8, participation=0.75, dropout=0.25,
                                            noise_multiplier=std / 0.05, eval_every=100), key=0)
        fed = InProcessFederation(setup, faults=lambda t, i: "lost" if (t, i) in lost else None)
        omega_sum = torch.zeros_like(fed.server.x)
        failures = 0
        for _ in range(6):
            report = fed.step()
            failures += len(report.crashed) + len(report.lost)
            for i in report.delivered:
                omega_sum += std * client_stream(0, i, "noise").normals([omega_sum.shape], report.round)[0] / 4
            torch.testing.assert_close(fed.server.g - fed.g.mean(0), 0.5 * omega_sum, rtol=0, atol=1e-5)
        assert failures > 2  # crashes and lost messages did happen
    rows = torch.randn(50, 30) * torch.logspace(-3, 3, 50).unsqueeze(1)
    out, shrunk = MessageClipping(0.1, "flat", [10, 20])(rows)
    assert (out.norm(dim=1) <= 0.1 * (1 + 1e-6)).all() and shrunk.any() and not shrunk.all()
    layer = MessageClipping(0.1, "per-layer", [10, 20])
    out, _ = layer(rows)
    assert (out[:, :10].norm(dim=1) <= 0.1 * (1 + 1e-6)).all() and (out[:, 10:].norm(dim=1) <= 0.1 * (1 + 1e-6)).all()
    assert layer.sensitivity == pytest.approx(0.1 * math.sqrt(2)) and out.norm(dim=1).max() > 0.1
    bad, _ = MessageClipping(0.1, "flat", [3])(torch.tensor([[float("nan"), 1.0, 2.0]]))
    assert torch.equal(bad, torch.zeros(1, 3))  # a non-finite message is sent as zero


def test_failures_continue_or_abort_without_corrupting_state():
    cfg = config(algorithm="clip21-sgd2m", beta=0.5, beta_hat=0.5, noise_multiplier=0.5)
    setup = build_setup(cfg, quadratic(A, torch.zeros(2), wobble=0.2))
    fed = InProcessFederation(setup, faults=lambda t, i: {(2, 0): "crash", (2, 1): "lost"}.get((t, i)))
    fed.step()
    before = (fed.v.clone(), fed.g.clone())
    report = fed.step()
    assert report.crashed == [0] and report.lost == [1] and report.delivered == [2]
    assert torch.equal(fed.v[:2], before[0][:2]) and torch.equal(fed.g[:2], before[1][:2])  # not committed
    assert not torch.equal(fed.g[2], before[1][2])
    assert fed.ledgers.releases() == [1, 2, 2]  # the crashed client released nothing, the lost message counts
    aborting = InProcessFederation(build_setup(FederatedConfig(**{**cfg.__dict__, "on_failure": "abort"}),
                                               quadratic(A, torch.zeros(2), wobble=0.2)),
                                   faults=lambda t, i: "lost" if (t, i) == (2, 1) else None)
    aborting.step()
    state = (aborting.server.x.clone(), aborting.server.g.clone(), aborting.g.clone(), aborting.v.clone())
    with pytest.raises(ClientFailure, match=r"round 2: the message\(s\) of client\(s\) \[1\] never arrived"):
        aborting.step()
    for a, b in zip(state, (aborting.server.x, aborting.server.g, aborting.g, aborting.v)):
        assert torch.equal(a, b)
    assert aborting.ledgers.releases() == [2, 2, 2]  # what was sent stays in the ledgers


# ------------------------------------------------------------------------------------------ accounting


def test_per_client_ledgers_are_the_gaussian_mechanism_with_sensitivity_two_tau():
    cfg = FederatedConfig(dataset="digits", model="logreg", clients=5, rounds=8, clip=0.5, noise_multiplier=3.0,
                          participation=0.6, batch_size=8, eval_every=100, delta=1e-6)
    result = run_inprocess(build_setup(cfg), progress=False, log=print)
    releases = result.metrics["releases_per_client"]
    assert releases == [sum(i in participants(cfg, t) for t in range(1, 9)) for i in range(5)]
    assert len(set(releases)) > 1
    for k, eps, ledger in zip(releases, result.metrics["epsilon_per_client"], result.metrics["ledgers"]):
        mu = math.sqrt(k) * 2 * 0.5 / (3.0 * 0.5)  # k Gaussian releases, sensitivity 2 tau, std 3 tau
        delta = norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)
        assert delta == pytest.approx(1e-6, rel=1e-6)
        core = PrivacyLedger.from_dict(ledger)  # the core ledger's PLD accountant agrees
        assert core.steps == k and core.epsilon(1e-6) == pytest.approx(eps, rel=2e-3)
    assert result.metrics["epsilon"] == max(result.metrics["epsilon_per_client"])


def test_noise_calibration():
    setup = build_setup(FederatedConfig(rounds=50, epsilon=4.0, delta=1e-5, clip=0.2, clipping="per-layer",
                                        dataset="digits", model="logreg"))
    assert setup.clipping.sensitivity == pytest.approx(0.2 * math.sqrt(2))  # weight and bias blocks
    assert setup.noise.std == pytest.approx(setup.noise.noise_multiplier * 0.2 * math.sqrt(2))
    assert 0.99 * 4.0 <= ledger_epsilon(ledger_of(setup.noise.noise_multiplier, 50), 1e-5) <= 4.0
    # Corollary 1's closed form (spec §4.6 scale check) and that it is conservative
    assert paper_noise_std(1.0, 100, 0.5, 1e-5) == pytest.approx(2 * 1097.3, rel=1e-4)
    assert paper_noise_std(1.0, 1000, 0.5, 1e-5) == pytest.approx(2 * 3706, rel=1e-3)
    assert noise_std_for(1.0, 100, 0.5, 1e-5, "accountant") < paper_noise_std(1.0, 100, 0.5, 1e-5) / 5
    assert ledger_epsilon(ledger_of(paper_noise_std(1.0, 100, 0.5, 1e-5), 100), 1e-5) < 0.5 / 5


def ledger_of(std: float, rounds: int):
    ledger = client_ledger()
    for _ in range(rounds):
        ledger.record(LocalNoise(std, 1.0).release())
    return ledger


# ------------------------------------------------------------------------------------------ data, oracle


def test_vectorised_oracle_equals_per_client_autograd():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 6 * 6, 4))
    xs, ys = torch.randn(40, 1, 6, 6), torch.randint(0, 4, (40,))
    parts = [torch.arange(0, 7), torch.arange(7, 25), torch.arange(25, 40)]
    loss = lambda out, y: nn.functional.cross_entropy(out, y, reduction="none")  # noqa: E731
    oracle = ModelOracle(model, loss, xs, ys, parts, batch_size=10, key=3, examples_per_call=20)
    x = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rows = oracle(x, [2, 0, 1], round=7)
    for row, i in zip(rows, [2, 0, 1]):
        batch = oracle.batch(i, 7)
        assert len(batch) == min(10, len(parts[i])) and set(batch.tolist()) <= set(parts[i].tolist())
        model.zero_grad()
        loss(model(xs[batch]), ys[batch]).mean().backward()
        torch.testing.assert_close(row, torch.cat([p.grad.reshape(-1) for p in model.parameters()]), atol=1e-6,
                                   rtol=1e-5)
    assert not torch.equal(oracle.batch(1, 7), oracle.batch(1, 8))  # fresh mini-batches each round


@pytest.mark.parametrize("split", ["iid", "label", "dirichlet"])
def test_partitions_cover_the_data_once(split):
    labels = torch.arange(10).repeat_interleave(30)[torch.randperm(300)]
    parts = partition(labels, 7, split, alpha=0.3, seed=1)
    assert len(parts) == 7 and all(len(p) > 0 for p in parts)
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(300))
    classes = [len(labels[p].unique()) for p in parts]
    if split == "label":
        assert max(classes) <= 3
    if split == "iid":
        assert min(classes) >= 8
    assert partition(labels, 7, split, alpha=0.3, seed=1)[3].tolist() == parts[3].tolist()


def test_a_given_partition():
    parts = [torch.arange(0, 100), torch.arange(100, 110), torch.arange(110, 1437)]
    cfg = FederatedConfig(dataset="digits", model="logreg", clients=3, noise_multiplier=1.0)
    problem = classification_problem(cfg, 0, parts)
    assert problem.client_sizes == [100, 10, 1327]
    assert set(problem.oracle.batch(1, 3).tolist()) <= set(range(100, 110))
    with pytest.raises(ValueError, match="needs 3 non-empty index sets"):
        classification_problem(cfg, 0, parts[:2] + [torch.arange(0)])


# ------------------------------------------------------------------------------------------ CLI, bad input


def test_cli_writes_metrics(tmp_path, capsys):
    assert main(["federated", "--algorithm", "clip21-sgd2m", "--dataset", "digits", "--model", "mlp",
                 "--clients", "4", "--rounds", "30", "--noise-multiplier", "0.01", "--lr", "0.5", "--clip", "0.5",
                 "--split", "label", "--out", str(tmp_path), "--no-progress"]) == 0
    m = json.loads((tmp_path / "metrics.json").read_text())
    for key in ["test_accuracy", "epsilon", "delta", "rounds", "algorithm", "epsilon_per_client"]:
        assert key in m
    assert m["algorithm"] == "clip21-sgd2m" and m["rounds"] == 30 and len(m["epsilon_per_client"]) == 4
    assert m["test_accuracy"] > 0.5
    state = torch.load(tmp_path / "model" / "model.pt", weights_only=True)  # dpopt train's export
    model = build_model("mlp", load_dataset("digits"))
    model.load_state_dict(state)
    assert sum(v.numel() for v in state.values()) == 64 * 128 + 128 + 128 * 10 + 10
    assert accuracy(model, load_dataset("digits").test) == m["test_accuracy"]  # the final server model
    assert "per-client epsilon" in capsys.readouterr().out
    again = ["federated", "--clients", "3", "--rounds", "3", "--epsilon", "8", "--delta", "1e-6",
             "--out", str(tmp_path), "--no-progress"]
    with pytest.raises(SystemExit) as e:  # dpopt train's conventions: an existing run is kept
        main(again)
    assert e.value.code == 2 and "already holds a run (metrics.json, model)" in capsys.readouterr().err
    assert main([*again, "--overwrite"]) == 0
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert 0.99 * 8 <= m["epsilon"] <= 8 and m["delta"] == 1e-6
    assert main(["federated", "--clients", "3", "--rounds", "4", "--noise-multiplier", "1", "--dropout", "0.5",
                 "--on-failure", "abort", "--out", str(tmp_path), "--overwrite", "--no-progress"]) == 3
    assert "before the round" in capsys.readouterr().err
    assert main(["federated", "--clients", "3", "--rounds", "2", "--noise-multiplier", "1", "--no-progress"]) == 0
    assert "wrote" not in capsys.readouterr().out  # --out is optional, as in dpopt train


def test_client_noise_comes_from_os_entropy_unless_a_secret_seed_is_given(tmp_path, capsys, monkeypatch):
    """Issue 20: two default runs with the same public --seed draw different noise (a fresh key each, stored
    nowhere); --secret-seed N replays it and metrics.json says so. No file of the run folder (metrics.json,
    model/model.pt: the state_dict alone) holds the key or the secret seed."""
    keys: list[bytes] = []

    def recorded_key() -> bytes:
        keys.append(secret_key())
        return keys[-1]

    monkeypatch.setattr(federated_config, "secret_key", recorded_key)
    flags = ["federated", "--model", "logreg", "--clients", "3", "--rounds", "3", "--noise-multiplier", "1",
             "--eval-every", "3", "--no-progress", "--seed", "4"]
    seed = ["--secret-seed", "987654321"]
    for name, extra in [("a", []), ("b", []), ("c", seed), ("d", seed)]:
        assert main([*flags, *extra, "--out", str(tmp_path / name)]) == 0
    x = {name: torch.load(tmp_path / name / "model" / "model.pt", weights_only=True) for name in "abcd"}
    assert all(x[name].keys() == {"1.weight", "1.bias"} for name in x)  # logreg: Flatten, Linear
    assert not torch.equal(x["a"]["1.weight"], x["b"]["1.weight"])
    assert torch.equal(x["c"]["1.weight"], x["d"]["1.weight"])
    secrets = {"a": [keys[0], keys[0].hex().encode()], "b": [keys[1], keys[1].hex().encode()],
               "c": [b"987654321"], "d": [b"987654321"]}
    for name, forms in secrets.items():
        files = [f for f in (tmp_path / name).rglob("*") if f.is_file()]
        assert {f.relative_to(tmp_path / name).as_posix() for f in files} == {"metrics.json", "model/model.pt"}
        for f in files:
            assert not any(secret in f.read_bytes() for secret in forms), f
    mode = {name: json.loads((tmp_path / name / "metrics.json").read_text())["secret_randomness"] for name in "ac"}
    assert mode == {"a": "os-entropy-key", "c": "secret-seed"}
    assert "REPLAYABLE" in capsys.readouterr().out
    assert "secret_seed" not in json.loads((tmp_path / "c" / "metrics.json").read_text())["config"]


BAD = [
    (dict(clip=0.0), "the clip radius tau must be a finite number > 0"),
    (dict(clip=float("nan")), "the clip radius tau must be a finite number > 0"),
    (dict(beta=0.0), r"beta must lie in \(0, 1\]"),
    (dict(beta=1.5), r"beta must lie in \(0, 1\]"),
    (dict(beta_hat=0.0), r"beta_hat must lie in \(0, 1\]"),
    (dict(algorithm="clip21-sgd", beta=0.5), "clip21-sgd has no momentum"),
    (dict(algorithm="fedavg"), "unknown algorithm 'fedavg'"),
    (dict(clients=0), "clients must be an integer >= 1"),
    (dict(rounds=0), "rounds must be an integer >= 1"),
    (dict(clients=2000), "2000 clients cannot each hold an example"),
    (dict(lr=-1.0), "the step size"),
    (dict(participation=0.0), r"participation .* must lie in \(0, 1\]"),
    (dict(dropout=1.0), r"dropout .* must lie in \[0, 1\)"),
    (dict(noise_multiplier=-1.0), "noise multiplier must be a finite number >= 0"),
    (dict(noise_multiplier=None), "give exactly one of epsilon"),
    (dict(epsilon=2.0), "give exactly one of epsilon"),
    (dict(noise_multiplier=None, epsilon=2.0, calibration="advanced-composition"), "proven for epsilon < 1"),
    (dict(clipping="automatic"), "unknown clipping mode 'automatic'; choose one of flat, per-layer"),
    (dict(clipping="layerwise"), "clipping 'layerwise' is now 'per-layer'"),
    (dict(calibration="paper"), "calibration 'paper' is now 'advanced-composition'"),
    (dict(split="dirichlet", dirichlet_alpha=0.0), "the Dirichlet concentration alpha must be > 0"),
    (dict(batch_size=0), "batch size must be an integer >= 1"),
]


@pytest.mark.parametrize("kw,message", BAD)
def test_bad_input_gets_a_clear_error(kw, message):
    base = dict(dataset="digits", model="logreg", noise_multiplier=1.0)
    with pytest.raises(ValueError, match=message):
        build_setup(FederatedConfig(**{**base, **kw}))


def test_cli_bad_input_and_missing_flower(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit) as e:
        main(["federated", "--clip", "-1", "--noise-multiplier", "1", "--out", str(tmp_path)])
    assert e.value.code == 2 and "tau must be a finite number > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["federated", "--tau", "1", "--noise-multiplier", "1", "--out", str(tmp_path)])
    assert e.value.code == 2 and "--tau is now --clip" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["federated", "--secure", "--noise-multiplier", "1", "--out", str(tmp_path)])
    assert e.value.code == 2 and "--secure is gone" in capsys.readouterr().err
    (tmp_path / "file").touch()
    with pytest.raises(SystemExit) as e:
        main(["federated", "--noise-multiplier", "1", "--out", str(tmp_path / "file" / "run")])
    assert e.value.code == 2 and "cannot write to the output folder" in capsys.readouterr().err
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flwr" else find(name, *a))
    with pytest.raises(SystemExit):
        main(["federated", "--engine", "flower", "--noise-multiplier", "1", "--out", str(tmp_path)])
    assert re.search(r"pip install 'dpopt\[flower\]'", capsys.readouterr().err)


def test_missing_r_data_says_how_to_get_it(monkeypatch, tmp_path):
    from dpopt.data import tabular
    from dpopt.data.datasets import DatasetNotFound

    monkeypatch.setattr(tabular, "data_roots", lambda: [tmp_path])
    monkeypatch.setattr(tabular, "R_LIBRARY", tmp_path)
    with pytest.raises(DatasetNotFound, match="apt-get download r-cran-mlbench && dpkg-deb -x"):
        tabular.tabular_arrays("sonar")
    x, y = tabular.tabular_arrays("breast-cancer")  # bundled with scikit-learn
    assert x.shape == (569, 30) and set(y.tolist()) == {0, 1}
