"""The trainer and the CLI: metrics, exact resume, atomic checkpoints, and clear errors for bad input."""

import json
import math
import re
import subprocess
import sys
import warnings

import dp_accounting as dpa
import pytest
import torch

from dpopt.algorithms import CONFIGS, Adam
from dpopt.checkpoint import CHECKPOINT, CheckpointError, load_checkpoint, save_checkpoint
from dpopt.cli import main
from dpopt.data import datasets
from dpopt.data.samplers import PoissonSampler
from dpopt.noise.rng import SecretStream
from dpopt.privacy import (FixedOrderParticipation, FixedParticipation, GaussianRelease, PoissonSampling, epsilon_of,
                           noise_multiplier_for)
from dpopt import report
from dpopt.run import loop as train_module
from dpopt.privacy import PrivacyLedger
from dpopt.privacy.statement import privacy_statement
from dpopt.run import TrainConfig, bar_epsilon, extended, resume, train
from helpers import quiet, train_keeping_epoch_one

QUICK = dict(epochs=2, batch_size=128, epsilon=2.0)


def test_account_and_calibrate_json(capsys):
    assert main(["account", "--noise-multiplier", "1.1", "--sample-rate", str(256 / 60000), "--steps", "14063",
                 "--delta", "1e-5", "--json"]) == 0
    eps = json.loads(capsys.readouterr().out)["epsilon"]
    assert eps == pytest.approx(2.38, abs=0.01)
    assert main(["calibrate", "--epsilon", "3", "--delta", "1e-5", "--sample-rate", "0.01", "--epochs", "5",
                 "--json"]) == 0
    z = json.loads(capsys.readouterr().out)["noise_multiplier"]
    got = epsilon_of([GaussianRelease(z, PoissonSampling(0.01), 500)], 1e-5)
    assert 0.99 * 3 <= got <= 3


def test_train_writes_metrics(tmp_path, capsys):
    assert main(["train", "--epochs", "2", "--out", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "Privacy statement" in out and "test accuracy" in out
    m = json.loads((tmp_path / "metrics.json").read_text())
    for key in ["test_accuracy", "epsilon", "delta", "steps", "algorithm", "dataset"]:
        assert key in m
    assert m["epsilon"] <= 2.0 and m["dataset"] == "digits" and m["steps"] == 2 * 11
    assert m["test_accuracy"] > 0.5
    assert (tmp_path / CHECKPOINT).is_file()


@pytest.mark.parametrize("algorithm", ["dp-sgd", "dp-adam"])
def test_resume_reproduces_an_uninterrupted_run(tmp_path, algorithm):
    hp = CONFIGS[algorithm](lr=0.5 if algorithm == "dp-sgd" else 0.01)
    config = TrainConfig(algorithm=algorithm, hyperparameters=hp, **QUICK | {"epochs": 3})
    full = train_keeping_epoch_one(config, tmp_path / "full", tmp_path / "cut")  # its own OS-entropy key
    assert load_checkpoint(tmp_path / "cut")["step"] == 11
    resumed = resume(tmp_path / "cut", progress=False, log=quiet)
    a, b = load_checkpoint(tmp_path / "full"), load_checkpoint(tmp_path / "cut")
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k])
    assert resumed["epsilon"] == full["epsilon"] and resumed["steps"] == full["steps"]
    assert resumed["ledger"] == full["ledger"]


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, {"format": "dpopt-checkpoint-1", "step": 1})

    def dies_mid_write(obj, f):
        f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dies_mid_write)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, {"format": "dpopt-checkpoint-1", "step": 2})
    monkeypatch.undo()
    assert load_checkpoint(tmp_path)["step"] == 1


def test_missing_and_corrupt_checkpoints(tmp_path, capsys):
    with pytest.raises(CheckpointError, match="does not exist"):
        resume(tmp_path, progress=False, log=quiet)
    (tmp_path / CHECKPOINT).write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="corrupt"):
        resume(tmp_path, progress=False, log=quiet)
    with pytest.raises(SystemExit) as e:
        main(["train", "--resume", str(tmp_path)])
    assert e.value.code == 2 and "corrupt" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--epsilon", "0"], "epsilon must be"),
    (["--epsilon", "-1"], "epsilon must be"),
    (["--delta", "0"], "delta must lie in"),
    (["--delta", "1.5"], "delta must lie in"),
    (["--clip", "0"], "clip bound must be"),
    (["--noise-multiplier", "-2"], "noise multiplier must be"),
    (["--lr", "0"], "learning rate must be"),
    (["--model", "cnn"], "1x28x28"),
    (["--batch-size", "5000"], "batch size must lie in [1, 1437]"),
    (["--batch-size", "0"], "must be an integer >= 1"),
    (["--epochs", "0"], "must be an integer >= 1"),
    (["--trainable", "("], "not a regular expression"),
    (["--trainable", "head"], "matches no parameter of the model; its parameters are named 1.weight"),
    (["--secret-seed", "1", "--secure"], "not allowed with argument --secret-seed"),
    (["--physical-batch-size", "0"], "physical batch size must be an integer >= 1"),
    (["--physical-batch-size", "-4"], "physical batch size must be an integer >= 1"),
    (["--physical-batch-size", "5000"], "physical batch size (5000) exceeds the 1437 training examples"),
])
def test_bad_input_gets_a_clear_error(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--epochs", "1", "--no-progress", *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag,valid", [("--algorithm", "dp-adam"), ("--dataset", "mnist")])
def test_unknown_names_list_the_valid_ones(flag, valid, capsys):
    with pytest.raises(SystemExit):
        main(["train", flag, "nonsense"])
    assert valid in capsys.readouterr().err
    with pytest.raises(ValueError, match=valid):
        TrainConfig(**{flag[2:]: "nonsense", "epsilon": 1.0}).validate()


def test_missing_dataset_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "data_roots", lambda: [tmp_path])
    with pytest.raises(datasets.DatasetNotFound, match="dataset-fashion-mnist"):
        datasets.load_dataset("fashion-mnist")
    with pytest.raises(datasets.DatasetNotFound, match="--download"):
        datasets.load_dataset("mnist")


def test_large_delta_warns():
    with pytest.warns(UserWarning, match="1/n"):
        train(TrainConfig(epochs=1, epsilon=2.0, delta=0.01), progress=False, log=quiet)


def test_secure_mode_runs_and_is_not_reproducible():
    cfg = TrainConfig(epochs=1, epsilon=2.0, secure=True)
    a = train(cfg, progress=False, log=quiet)
    b = train(cfg, progress=False, log=quiet)
    assert a["epsilon"] == b["epsilon"] <= 2.0
    assert a["history"][0]["train_loss"] != b["history"][0]["train_loss"]
    with pytest.raises(ValueError, match="takes no --secret-seed"):
        TrainConfig(epochs=1, epsilon=2.0, secure=True, secret_seed=1).validate()


def test_mnist_loads_from_the_shared_folder():
    try:
        data = datasets.load_dataset("mnist")
    except datasets.DatasetNotFound:
        pytest.skip("MNIST is not beside this checkout")
    assert len(data) == 60000 and len(data.test[1]) == 10000
    assert torch.bincount(data.train[1]).tolist()[:3] == [5923, 6742, 5958]
    assert data.train[1][:5].tolist() == [5, 0, 4, 1, 9]


def test_the_console_script_runs_the_demo_without_arguments():
    """`dpopt` with no arguments trains on digits and prints the accuracy and epsilon."""
    out = subprocess.run([sys.executable, "-m", "dpopt.cli"], capture_output=True, text=True, check=True,
                         timeout=300).stdout
    last = out.strip().splitlines()[-1]
    match = re.match(r"test accuracy ([0-9.]+) at epsilon ([0-9.]+) \(delta 1e-05\)", last)
    assert match, last
    assert float(match[1]) > 0.85 and 0.99 * 2.0 <= float(match[2]) <= 2.0


def test_no_warning_for_normal_runs():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(TrainConfig(epochs=1, epsilon=2.0), progress=False, log=quiet)


def test_account_with_rdp_on_request(capsys):
    assert main(["account", "--noise-multiplier", "1.1", "--sample-rate", str(256 / 60000), "--steps", "14063",
                 "--delta", "1e-5", "--accountant", "rdp", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["epsilon"] == pytest.approx(2.60, abs=0.01)


def test_default_runs_with_the_same_seed_draw_different_noise(tmp_path):
    """The public --seed never keys the secret streams: each default run draws its own key from OS entropy
    (before issue 20 the noise was derived from --seed, so anyone who knew it could remove the noise)."""
    for name in "ab":
        train(TrainConfig(epochs=1, epsilon=2.0, seed=3), tmp_path / name, progress=False, log=quiet)
    a, b = (load_checkpoint(tmp_path / name) for name in "ab")
    assert len(a["rng"]["secret_key"]) == 32 and a["rng"]["secret_key"] != b["rng"]["secret_key"]
    assert not all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_secret_seed_replays_the_noise_and_seed_is_only_public(tmp_path):
    runs = {"a": (0, 3), "b": (0, 3), "c": (0, 4), "d": (1, 3)}  # name: (seed, secret seed)
    for name, (seed, secret) in runs.items():
        train(TrainConfig(epochs=1, epsilon=2.0, seed=seed, secret_seed=secret), tmp_path / name, progress=False,
              log=quiet)
    models = {name: load_checkpoint(tmp_path / name)["model"] for name in runs}
    assert all(torch.equal(models["a"][k], models["b"][k]) for k in models["a"])
    assert not all(torch.equal(models["a"][k], models["c"][k]) for k in models["a"])
    init = {name: initial_state(TrainConfig(epochs=1, epsilon=2.0, seed=seed)) for name, (seed, _) in runs.items()}
    assert all(torch.equal(init["a"][k], init["c"][k]) for k in init["a"])  # --seed: initialisation
    assert not all(torch.equal(init["a"][k], init["d"][k]) for k in init["a"])
    stream = PoissonSampler.with_batch_size(1437, 128, SecretStream(3, "sampling"))
    assert all(torch.equal(stream.batch(t), PoissonSampler.with_batch_size(
        1437, 128, SecretStream(3, "sampling")).batch(t)) for t in range(3))


@pytest.mark.curves
def test_the_secret_key_and_seed_are_only_in_the_checkpoint_and_the_export_holds_only_tensors(tmp_path, capsys):
    """Every file of a run folder but the (private) checkpoint is free of the key and of the secret seed;
    OUT/model/model.pt is the model's state_dict and nothing else."""
    assert main(["train", "--epochs", "1", "--out", str(tmp_path / "key"), "--no-progress"]) == 0
    assert main(["train", "--epochs", "1", "--secret-seed", "987654321", "--out", str(tmp_path / "seed"),
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    key = load_checkpoint(tmp_path / "key")["rng"]["secret_key"]
    assert load_checkpoint(tmp_path / "seed")["rng"]["secret_key"] == 987654321
    secrets = {"key": [key, key.hex().encode()], "seed": [b"987654321"]}
    for name, forms in secrets.items():
        files = [f for f in (tmp_path / name).rglob("*") if f.is_file() and f.name != CHECKPOINT]
        names = {f.relative_to(tmp_path / name).as_posix() for f in files}
        assert {n for n in names if not n.startswith("tensorboard/")} == {  # events where tensorboard is installed
            "metrics.json", "model/model.pt", "train.log", "curves.png"}
        for f in files:
            assert not any(secret in f.read_bytes() for secret in forms), f
        model = torch.load(tmp_path / name / "model" / "model.pt", weights_only=True)
        state = load_checkpoint(tmp_path / name)["model"]
        assert model.keys() == state.keys() and all(torch.equal(model[k], state[k]) for k in state)
    assert "987654321" not in out and key.hex() not in out
    metrics = {name: json.loads((tmp_path / name / "metrics.json").read_text()) for name in secrets}
    assert metrics["key"]["secret_randomness"] == "os-entropy-key" and "secret_seed" not in metrics["key"]["config"]
    assert metrics["seed"]["secret_randomness"] == "secret-seed"
    assert "REPLAYABLE" in metrics["seed"]["privacy_statement"]


def test_noise_multiplier_replaces_epsilon(tmp_path):
    assert main(["train", "--noise-multiplier", "1.5", "--epochs", "1", "--out", str(tmp_path), "--no-progress"]) == 0
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["noise_multiplier"] == 1.5 and m["config"]["epsilon"] is None
    assert m["epsilon"] == pytest.approx(epsilon_of([GaussianRelease(1.5, PoissonSampling(128 / 1437), m["steps"])],
                                                    1e-5))


@pytest.mark.parametrize("sampling", ["shuffle", "fixed"])
def test_shuffled_and_fixed_batches_are_accounted_without_amplification(sampling):
    m = train(TrainConfig(epochs=2, epsilon=2.0, sampling=sampling), progress=False, log=quiet)
    period = -(-1437 // 128)
    assert m["steps"] == 2 * period and m["sample_rate"] is None
    participation = (FixedOrderParticipation if sampling == "fixed" else FixedParticipation)(period)
    assert m["ledger"]["entries"] == [GaussianRelease(m["noise_multiplier"], participation, m["steps"]).to_dict()]
    assert 0.99 * 2.0 <= m["epsilon"] <= 2.0
    poisson_z = noise_multiplier_for(2.0, 1e-5, PoissonSampling(128 / 1437), m["steps"])
    assert m["noise_multiplier"] > 2 * poisson_z, "no amplification may be assumed"


def test_nonfinite_gradients_in_training_contribute_zero_warn_and_are_counted(monkeypatch):
    def digits_with_a_nan(download=False):
        data = datasets.digits()
        data.train[0][-1, 0, 3, 3] = float("nan")  # the last example: never in the probes of the first batch
        return data

    monkeypatch.setitem(datasets.DATASETS, "digits", digits_with_a_nan)
    config = TrainConfig(epochs=2, epsilon=2.0, secret_seed=5)
    with pytest.warns(UserWarning, match="non-finite gradients"):
        m = train(config, progress=False, log=quiet)
    sampler = PoissonSampler.with_batch_size(1437, 128, SecretStream(config.secret_seed, "sampling"))
    sampled = sum(int((sampler.batch(t) == 1436).any()) for t in range(m["steps"]))
    assert m["nonfinite_examples"] == sampled > 0
    assert math.isfinite(m["history"][-1]["test_accuracy"]) and m["test_accuracy"] > 0.5


def test_checkpoint_holds_model_optimizer_ledger_sampler_and_rng_and_refuses_a_changed_sampler(tmp_path):
    train(TrainConfig(epochs=2, epsilon=2.0, algorithm="dp-adam", hyperparameters=Adam(lr=0.01)), tmp_path,
          progress=False, log=quiet)
    state = load_checkpoint(tmp_path)
    assert {"model", "optimizer", "ledger", "sampler", "rng", "config", "step"} <= set(state)
    assert state["optimizer"]["base"]["state"], "Adam's moments are saved"
    assert state["sampler"]["next_step"] == state["step"] == 22 and state["sampler"]["dataset_size"] == 1437
    assert state["sampler"]["participation"] == {"kind": "PoissonSampling", "rate": 128 / 1437}
    state["config"]["epochs"] = 3
    save_checkpoint(tmp_path, state)
    assert resume(tmp_path, progress=False, log=quiet)["steps"] == 33  # a longer run continues the same one
    state = load_checkpoint(tmp_path)
    state["config"]["epochs"], state["sampler"]["dataset_size"] = 4, 1000  # as if the data had changed
    save_checkpoint(tmp_path, state)
    with pytest.raises(CheckpointError, match="sampler"):
        resume(tmp_path, progress=False, log=quiet)
    del state["rng"]["secret_key"]  # a checkpoint from before keys were (noise derived from the public seed)
    save_checkpoint(tmp_path, state)
    with pytest.raises(CheckpointError, match="holds no secret key"):
        resume(tmp_path, progress=False, log=quiet)
    state["rng"]["secret_key"] = None
    del state["sampler"]  # a checkpoint from before samplers were recorded
    save_checkpoint(tmp_path, state)
    with pytest.raises(CheckpointError, match="lacks sampler"):
        resume(tmp_path, progress=False, log=quiet)


@pytest.mark.parametrize("algorithm", ["dp-adam", "dpzero"])
def test_trainable_trains_only_the_matching_parameters(tmp_path, algorithm):
    """--trainable freezes every other parameter: the checkpoint's frozen tensors are the initial ones, the
    chosen ones moved, and the run's ledger is the same as training everything (privacy does not depend on
    which parameters are trained)."""
    config = TrainConfig(algorithm=algorithm, epochs=1, epsilon=2.0, trainable=r"^3\.",
                         hyperparameters=CONFIGS[algorithm](lr=0.05))
    metrics = train(config, tmp_path / "head", progress=False, log=quiet)
    full = train(TrainConfig(algorithm=algorithm, epochs=1, epsilon=2.0, hyperparameters=CONFIGS[algorithm](lr=0.05)),
                 tmp_path / "all", progress=False, log=quiet)
    head, everything = load_checkpoint(tmp_path / "head")["model"], load_checkpoint(tmp_path / "all")["model"]
    initial = initial_state(config)
    for name, value in head.items():
        assert torch.equal(value, initial[name]) == (not name.startswith("3.")), name
        assert not torch.equal(everything[name], initial[name]), name
    assert metrics["epsilon"] == full["epsilon"] and metrics["steps"] == full["steps"]


def initial_state(config: TrainConfig) -> dict[str, torch.Tensor]:
    """The model a run starts from (built under the run's public init seed)."""
    from dpopt.run import build_run

    return {k: v.clone() for k, v in build_run(config, log=quiet).model.state_dict().items()}


def test_the_statement_compares_delta_with_one_over_n():
    """MNIST's 60,000 examples at the default delta 1e-5: 0.6 of 1/n, which "well below 1/n" did not flag."""
    ledger = PrivacyLedger()
    ledger.record(GaussianRelease(1.0, PoissonSampling(0.01), 100))
    assert "delta is 0.014 times 1/n = 0.000696, well below it." in privacy_statement(ledger, 1e-5, 1437)
    assert "delta is 0.6 times 1/n = 1.67e-05; the usual rule is delta well below 1/n (e.g. --delta 2e-06)." in \
        privacy_statement(ledger, 1e-5, 60000)


def test_privacy_statement_says_whether_the_noise_is_replayable():
    def statement(**mode) -> str:
        return train(TrainConfig(epochs=1, epsilon=2.0, **mode), progress=False, log=quiet)["privacy_statement"]

    default, seeded, secure = statement(), statement(secret_seed=1), statement(secure=True)
    assert "secret key drawn from OS entropy, held in memory and, where the run has a folder, in its checkpoint alone" \
        in default
    assert "REPLAYABLE" in seeded and "--secret-seed" in seeded and "REPLAYABLE" not in default
    assert "draw by draw" in secure and "REPLAYABLE" not in secure


# ------------------------------------------------------------------- issue 23: the first hour of a new user


def test_resume_refuses_changed_flags_and_extends_with_a_larger_epochs(tmp_path, capsys, monkeypatch):
    """--resume DIR with flags: the same values pass, a larger --epochs extends the run (the noise keeps the
    multiplier calibrated for the original length, so epsilon passes the target), anything else is refused
    with the list of differences; correlated noise, built for a fixed length, cannot be extended. The checkpoint
    the flags are checked against is the one resumed: read once, not held twice."""
    run = str(tmp_path / "run")
    assert main(["train", "--epochs", "1", "--out", run, "--no-progress"]) == 0
    first = json.loads((tmp_path / "run" / "metrics.json").read_text())
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["train", "--resume", run, "--epochs", "2", "--lr", "0.3", "--algorithm", "dp-adam",
              "--physical-batch-size", "32"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "--algorithm dp-adam (the run has dp-sgd); --lr 0.3 (the run has 0.5); --physical-batch-size 32 (the run " \
           "has none given: the default)" in err
    reads = []
    for module in (sys.modules["dpopt.cli"], train_module):
        monkeypatch.setattr(module, "load_checkpoint", lambda d, read=module.load_checkpoint: reads.append(d) or read(d))
    assert main(["train", "--resume", run, "--epochs", "2", "--lr", "0.5", "--epsilon", "2", "--no-progress"]) == 0
    assert "extending the run from 1 to 2 epochs" in capsys.readouterr().out and reads == [run]
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["steps"] == 22 and m["noise_multiplier"] == first["noise_multiplier"] and m["epsilon"] > 2.0
    with pytest.raises(SystemExit) as e:
        main(["train", "--resume", run, "--epochs", "1"])
    assert e.value.code == 2 and "--epochs 1 is below the run's 2" in capsys.readouterr().err
    with pytest.raises(ValueError, match="tree noise is built for the run's 1 epochs and cannot be extended"):
        extended(TrainConfig(algorithm="dp-srgd", epochs=1, epsilon=1.0, sampling="fixed"), 2, 10)
    with pytest.raises(ValueError, match="banded noise is built for the run's 1 epochs"):  # amplified BandMF
        extended(TrainConfig(algorithm="dp-memf", epochs=1, epsilon=1.0), 2, 10)
    fixed = TrainConfig(algorithm="dp-memf", epochs=20, epsilon=1.0, sampling="fixed")
    with pytest.raises(ValueError, match="^mf noise is built for"):  # dense mf up to 2,048 steps
        extended(fixed, 21, 100)
    with pytest.raises(ValueError, match="^banded noise is built for"):  # auto mf became banded beyond
        extended(fixed, 21, 469)


def test_an_existing_run_is_refused_unless_overwrite_and_out_is_checked_before_training(tmp_path, capsys):
    run = str(tmp_path / "run")
    assert main(["train", "--epochs", "1", "--out", run, "--no-progress"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["train", "--epochs", "1", "--out", run])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "already holds a run (checkpoint.pt, metrics.json" in err and "--resume" in err
    (tmp_path / "run" / "checkpoint.pt").rename(tmp_path / "checkpoint.pt")  # as a federated run's folder: no checkpoint
    with pytest.raises(SystemExit):
        main(["train", "--epochs", "1", "--out", run])
    err = capsys.readouterr().err
    assert "already holds a run (metrics.json" in err and "--resume" not in err  # nothing there to resume
    assert main(["train", "--epochs", "1", "--out", run, "--overwrite", "--no-progress"]) == 0
    assert (tmp_path / "run" / "train.log").read_text().count("Privacy statement") == 1  # the old log went too
    capsys.readouterr()
    (tmp_path / "file").touch()
    with pytest.raises(SystemExit) as e:
        main(["train", "--epochs", "1", "--out", str(tmp_path / "file" / "run")])
    captured = capsys.readouterr()
    assert e.value.code == 2 and "cannot write to the output folder" in captured.err
    assert captured.out == ""  # refused before the data was loaded or the noise calibrated


class RecordingWriter:
    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


@pytest.mark.curves
def test_the_run_folder_has_metrics_from_the_first_evaluation_a_log_curves_and_tensorboard_events(tmp_path,
                                                                                                  monkeypatch):
    writer = RecordingWriter()
    monkeypatch.setattr(train_module, "tensorboard_writer", lambda folder, purge_step: writer)
    seen = {}

    def log(line: str) -> None:
        if line.startswith("epoch 1/"):
            seen["metrics"] = json.loads((tmp_path / "metrics.json").read_text())

    train(TrainConfig(epochs=2, epsilon=2.0), tmp_path, progress=False, log=log)
    assert seen["metrics"]["finished"] is False and len(seen["metrics"]["history"]) == 1
    assert json.loads((tmp_path / "metrics.json").read_text())["finished"] is True
    logged = (tmp_path / "train.log").read_text()
    assert "calibrated noise multiplier" in logged and "epoch 2/2" in logged and "Guarantee:" in logged
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert [s for t, _, s in writer.scalars if t == "train/loss"] == list(range(1, 23))
    assert [s for t, _, s in writer.scalars if t == "eval/epsilon"] == [11, 22] and writer.closed


def test_tensorboard_events_read_back_match_metrics_json_and_a_resumed_run_logs_each_step_once(tmp_path,
                                                                                               monkeypatch):
    """With tensorboard installed: a run interrupted at step 8 (after its checkpoint at step 5) and resumed
    leaves events that TensorBoard reads as one loss per step and, per epoch, the test accuracy and epsilon
    of metrics.json; the interrupted run's events past step 5 are hidden (purged)."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    real, opened = report.tensorboard_writer, []

    def crashing(folder, purge_step):
        writer = real(folder, purge_step)
        opened.append(writer)
        add = writer.add_scalar

        def add_scalar(tag: str, value: float, step: int) -> None:
            add(tag, value, step)
            if step == 8:  # what a killed process leaves: its events flushed, no checkpoint since step 5
                writer.flush()
                raise KeyboardInterrupt

        writer.add_scalar = add_scalar
        return writer

    run = str(tmp_path / "run")
    monkeypatch.setattr(train_module, "tensorboard_writer", crashing)
    with pytest.raises(KeyboardInterrupt):
        main(["train", "--dataset", "digits", "--model", "mlp", "--epochs", "2", "--checkpoint-every", "5",
              "--out", run, "--no-progress"])
    opened[0].close()
    monkeypatch.undo()
    assert load_checkpoint(run)["step"] == 5
    assert main(["train", "--resume", run, "--no-progress"]) == 0
    assert len(list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))) == 2
    events = event_accumulator.EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    history = json.loads((tmp_path / "run" / "metrics.json").read_text())["history"]
    assert [step for step, _ in scalars["train/loss"]] == list(range(1, 23))
    for key in ["test_accuracy", "epsilon", "train_loss"]:
        assert [step for step, _ in scalars[f"eval/{key}"]] == [h["step"] for h in history] == [11, 22]
        assert [value for _, value in scalars[f"eval/{key}"]] == pytest.approx([h[key] for h in history],
                                                                               rel=1e-6)


@pytest.mark.curves
def test_without_matplotlib_or_tensorboard_the_run_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(report.importlib.util, "find_spec", lambda name: None)
    lines: list[str] = []
    train(TrainConfig(epochs=1, epsilon=2.0), tmp_path, progress=False, log=lines.append)
    assert any("matplotlib is not installed" in line for line in lines) and not (tmp_path / "curves.png").exists()
    assert any("tensorboard is not installed" in line for line in lines)


def test_the_progress_bar_shows_epsilon_spent_at_every_step(monkeypatch):
    """From the first step on (it showed 0 through the first epoch), labelled with its accountant: RDP, from
    cached one-step curves (what dp-accounting's RdpAccountant gives), where RDP applies; the count drawn with it
    is the step's (an iterating bar drew 0/11 through a digits epoch)."""
    postfixes, counts = [], []

    class Bar:
        def __init__(self, initial, total, **kwargs):
            self.n = initial

        def set_postfix(self, refresh=True, **kwargs):
            postfixes.append(kwargs)

        def update(self):
            self.n += 1
            counts.append(self.n)

        def close(self):
            pass

    monkeypatch.setattr(train_module, "tqdm", Bar)
    m = train(TrainConfig(epochs=1, epsilon=2.0), progress=True, log=quiet)
    eps = [float(p["eps"].removesuffix(" (RDP)")) for p in postfixes]
    assert len(eps) == 11 and 0 < eps[0] < eps[-1] and all(a < b for a, b in zip(eps, eps[1:]))
    assert counts == list(range(1, 12))
    z, q = m["noise_multiplier"], m["sample_rate"]
    accountant = dpa.rdp.RdpAccountant()
    accountant.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), 11))
    assert postfixes[-1]["eps"] == f"{accountant.get_epsilon(1e-5):.3g} (RDP)"
    ledger = PrivacyLedger("replace-one")
    ledger.record(GaussianRelease(z, PoissonSampling(q), 3))
    assert bar_epsilon(ledger, 1e-5) == f"{ledger.epsilon(1e-5):.3g} (PLD)"  # RDP has no analysis of this


def test_the_privacy_statement_names_the_guarantee_first_and_never_a_bare_epsilon_0():
    ledger = PrivacyLedger()
    ledger.record(GaussianRelease(3.3e4, PoissonSampling(0.089), 11))  # what --epsilon 1e-4 calibrates on digits
    lines = privacy_statement(ledger, 1e-5).splitlines()
    assert lines[2].startswith("Guarantee: (") and "by PLD accounting" in lines[2]
    assert lines[3] == ("Cross-check: RDP accounting bounds epsilon by 0 (delta alone covers the privacy loss at "
                        "this noise); an independent upper bound, not the guarantee.")
    ledger = PrivacyLedger(accountant="rdp")
    ledger.record(GaussianRelease(1.0, PoissonSampling(0.089), 11))
    lines = privacy_statement(ledger, 1e-5).splitlines()
    assert "by RDP accounting" in lines[2] and lines[3].startswith("Cross-check: PLD accounting bounds epsilon by")


@pytest.mark.parametrize("argv,hint", [
    (["train", "--algorithm", "dp-sdg"], "did you mean 'dp-sgd'?"),
    (["train", "--dataset", "mnsit"], "did you mean 'mnist'?"),
    (["train", "--algoritm", "dp-sgd"], "did you mean '--algorithm'?"),
    (["trian"], "did you mean 'train'?"),
    (["reproduce", "crash_safty"], "did you mean 'crash_safety'?"),
    (["train", "--model", "mpl"], "did you mean 'mlp'?"),
    (["train", "--algorithm", "DP-SGD"], "did you mean 'dp-sgd'?"),
    (["train", "--dataset", "MNIST"], "did you mean 'mnist'?"),
])
def test_errors_are_short_with_did_you_mean(argv, hint, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) <= 2 and err[0].startswith("dpopt: error: ") and hint in err[0]


def test_reproduce_help_lists_each_reproduction_with_a_description(capsys):
    assert main(["reproduce", "--help"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = {line.split()[0]: line for line in lines[2:]}
    assert "crash_safety" in rows and "SIGKILL" in rows["crash_safety"]
    assert all(len(line.split(maxsplit=1)) == 2 and len(line) < 140 for line in rows.values())
