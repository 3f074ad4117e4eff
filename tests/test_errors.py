"""Bad input gets a clear error: the rows of docs/errors.md that no other test file covers."""

import dataclasses
import importlib
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import mlp_loss, quiet
from torch import nn

from dpopt import extras
from dpopt.run import build as train_module
from dpopt.algorithms import hyperparameters_for
from dpopt.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from dpopt.cli import main
from dpopt.clipping import Clipping
from dpopt.data import tabular
from dpopt.data.datasets import Dataset, load_dataset
from dpopt.data.samplers import PoissonSampler
from dpopt.grad import ExampleMixingError, PerExampleEngine, batch_size_of
from dpopt.noise.gaussian import GaussianNoise
from dpopt.noise.mechanisms import MAX_DENSE_STEPS, build_noise
from dpopt.noise.rng import SecretStream
from dpopt.privacy import PoissonSampling, PrivacyLedger, Relation, noise_multiplier_for
from dpopt.run import TrainConfig, resume, train
from dpopt.plan import mechanism


def refused(message: str, **fields) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**({"epsilon": 1.0} | fields)).validate()


def test_budget():
    refused("epsilon must be a finite number > 0", epsilon=math.nan)
    refused("epsilon must be a finite number > 0", epsilon=math.inf)
    refused("noise multiplier must be a finite number > 0", epsilon=None, noise_multiplier=0.0)
    refused("noise multiplier must be a finite number > 0", epsilon=None, noise_multiplier=math.nan)
    refused("exactly one of epsilon", noise_multiplier=1.0)
    refused("exactly one of epsilon", epsilon=None)
    with pytest.raises(ValueError, match="noise multiplier must be >= 0"):
        GaussianNoise(-1.0, 1.0, SecretStream(0, "noise"))


def test_unreachable_target_is_refused():
    with pytest.raises(ValueError, match="no noise multiplier below 1e6"):
        noise_multiplier_for(1e-9, 1e-12, PoissonSampling(1.0), 10**9, "rdp")


@pytest.mark.parametrize("algorithm,fields,message", [
    ("dp-sgd", dict(lr=math.nan), "learning rate"), ("dp-sgd", dict(momentum=1.0), "momentum must lie in"),
    ("dp-adamw", dict(weight_decay=-0.1), "weight decay must be >= 0"),
    ("dp-adam", dict(betas=(0.9, 1.0)), r"betas must be two numbers in \[0, 1\)"),
    ("disk-sgd", dict(kappa=0.0), r"kappa must lie in \(0, 1\]"), ("dp-grape", dict(rank=0), "rank must be >= 1"),
])
def test_optimizer_hyperparameters(algorithm, fields, message):
    with pytest.raises(ValueError, match=message):
        hyperparameters_for(algorithm, **fields)


@pytest.mark.parametrize("field,valid", [
    ("model", "cnn, logreg, minilm"), ("sampling", "fixed, poisson, shuffle"), ("per_example", "hooks, vmap"),
    ("strategy", "auto, ghost, materialize"), ("accountant", "pld, rdp"),
])
def test_unknown_names_list_the_valid_ones(field, valid):
    refused(valid, **{field: "nonsense"})


def test_unknown_relation_and_experiment(capsys):
    with pytest.raises(ValueError, match="add-remove, replace-one"):
        Relation("neighbours")
    refused("add-remove, replace-one", relation="neighbours")
    with pytest.raises(SystemExit) as e:
        main(["reproduce", "nonsense"])
    assert e.value.code == 2 and "crash_safety" in capsys.readouterr().err


def test_checkpoint_every_and_nproc(capsys):
    refused("checkpoint_every must be >= 0", checkpoint_every=-1)
    with pytest.raises(SystemExit):
        main(["train", "--checkpoint-every", "-3"])
    assert "checkpoint_every must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--nproc", "0"])
    assert "must be an integer >= 1" in capsys.readouterr().err


def test_dense_mf_noise_beyond_its_reach_is_refused_before_training(capsys):
    with pytest.raises(ValueError, match="dense mf noise over 2049 steps is out of reach"):
        build_noise("mf", 1.0, 1.0, SecretStream(0, "noise"), MAX_DENSE_STEPS + 1, 100)
    with pytest.raises(SystemExit) as e:  # digits, batch 1, 2 epochs: 2874 steps, refused before the first one
        main(["train", "--algorithm", "dp-memf", "--noise", "mf", "--batch-size", "1", "--epochs", "2", "--no-progress"])
    assert e.value.code == 2 and "use --noise tree, or banded" in capsys.readouterr().err
    # on fixed-order batches with --noise auto, the recipe's dense mf gives way to banded noise there
    config = TrainConfig(algorithm="dp-memf", epsilon=1.0, sampling="fixed")
    assert mechanism(config, MAX_DENSE_STEPS) == "mf" and mechanism(config, MAX_DENSE_STEPS + 1) == "banded"
    assert mechanism(dataclasses.replace(config, sampling="auto"), 10) == "banded"  # amplified BandMF
    assert mechanism(dataclasses.replace(config, noise="mf"), MAX_DENSE_STEPS + 1) == "mf"
    # a recipe's own tree noise gives way to banded noise under cyclic sampling (by default)
    for algorithm, sampling, kind in [("dp-ftrl", "auto", "banded"), ("dp-ftrl", "fixed", "tree"),
                                      ("dp-srgd", "auto", "banded"), ("dp-srgd", "fixed", "tree")]:
        assert mechanism(TrainConfig(algorithm=algorithm, epsilon=1.0, sampling=sampling), 10) == kind
    assert mechanism(TrainConfig(algorithm="dp-srgd", sampling="cyclic", noise="tree"), 10) == "tree"


def test_nonfinite_examples_in_a_run_are_zeroed_counted_and_warned(monkeypatch):
    """NaN inputs among the first examples (where the probe and the engine's self-check look too)."""
    digits = load_dataset("digits")
    x = digits.train[0].clone()
    x[[0, 3, 5, 700]] = math.nan
    poisoned = Dataset("digits", (x, digits.train[1]), digits.test, digits.num_classes)
    monkeypatch.setattr(train_module, "load_dataset", lambda *_: poisoned)
    with pytest.warns(UserWarning, match="non-finite gradients in epoch 1"):
        metrics = train(TrainConfig(model="logreg", epochs=1, noise_multiplier=1.0, accountant="rdp", secret_seed=0),
                        progress=False, log=quiet)  # replayable: over 30 fresh keys, accuracy min 0.46, mean 0.55
    assert 1 <= metrics["nonfinite_examples"] == metrics["history"][0]["nonfinite"]
    assert math.isfinite(metrics["history"][0]["train_loss"])  # the progress loss leaves them out too
    assert metrics["test_accuracy"] > 0.3  # NaN parameters would predict one class (~10%)


def test_checkpoints_from_elsewhere(tmp_path):
    torch.save({"weights": torch.zeros(2)}, tmp_path / "checkpoint.pt")
    with pytest.raises(CheckpointError, match="not a dpopt checkpoint"):
        load_checkpoint(tmp_path)
    train(TrainConfig(model="logreg", epochs=1, noise_multiplier=1.0, accountant="rdp"), tmp_path, False, quiet)
    state = load_checkpoint(tmp_path)
    save_checkpoint(tmp_path, state | {"config": state["config"] | {"turbo": True}})
    with pytest.raises(ValueError, match="unknown config keys: turbo"):
        resume(tmp_path, progress=False, log=quiet)
    with pytest.raises(ValueError, match="unknown release mechanism in ledger: 'tree'"):
        PrivacyLedger.from_dict({"relation": "add-remove", "accountant": "pld", "entries": [{"mechanism": "tree"}]})


def test_engine_inputs():
    engine = PerExampleEngine(nn.Linear(4, 2), mlp_loss)
    with pytest.raises(ValueError, match="at least one tensor with a leading batch dimension"):
        batch_size_of((torch.tensor(1.0),))
    with pytest.raises(ValueError, match="`at` needs 2 tensors, got 1"):
        engine.gradients((torch.randn(3, 4), torch.zeros(3, dtype=torch.long)), at=[torch.zeros(2, 4)])
    unused = PerExampleEngine(nn.Linear(4, 2), lambda m, b: b[0].square().sum(1))
    with pytest.raises(ValueError, match="does not depend on any trainable parameter"):
        unused.gradients((torch.randn(3, 4), torch.zeros(3)))
    with pytest.raises(ValueError, match="automatic clipping needs stability > 0"):
        Clipping(1.0, "automatic", stability=0.0)
    with pytest.raises(ValueError, match="the dataset is empty"):
        PoissonSampler(0, 0.5, SecretStream(0, "sampling"))


class Regrouped(nn.Module):
    """Feeds a Linear rows that are not example-major: [B, 2, d] -> [2, B, d] -> [2B, d]."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x):
        b = x.shape[0]
        h = self.lin(x.transpose(0, 1).reshape(-1, 3)).reshape(2, b, 3).transpose(0, 1)
        return self.head(torch.tanh(h).mean(1))


def test_rows_that_cannot_be_attributed_to_examples():
    class Uneven(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.head = nn.Linear(3, 3), nn.Linear(4, 2)

        def forward(self, x):  # [6, 4] -> 8 rows of 3: not a whole number of rows per example
            return self.head(self.lin(x.reshape(-1, 3)).reshape(x.shape[0], 4))

    with pytest.raises(ValueError, match="cannot be attributed to examples"):
        PerExampleEngine(Uneven(), mlp_loss).gradients((torch.randn(6, 4), torch.zeros(6, dtype=torch.long)))
    with pytest.raises(ExampleMixingError, match=r"torch.func could not take them per example over '<root>'"):
        PerExampleEngine(Uneven(), mlp_loss).verify((torch.randn(6, 4), torch.zeros(6, dtype=torch.long)))
    engine = PerExampleEngine(Regrouped(), mlp_loss)  # rows in the wrong order: found, and taken with torch.func
    engine.verify((torch.randn(5, 2, 3), torch.randint(0, 2, (5,))))
    assert {engine.names[i] for i in engine.routes[""]} == {"lin.weight", "lin.bias"}


def test_every_row_of_the_error_table_names_an_existing_test():
    table = (Path(__file__).parents[1] / "docs" / "errors.md").read_text()
    refs = set(re.findall(r"(test_\w+)::(test_\w+)", table))
    assert len(refs) > 20
    for module, test in sorted(refs):
        source = Path(__file__).with_name(f"{module}.py").read_text()
        assert re.search(rf"^def {test}\(", source, re.M), f"docs/errors.md cites {module}::{test}, which is missing"


@pytest.mark.parametrize("module,argv,extra", [
    ("rdata", ["--dataset", "ionosphere"], "tabular"),
    ("datasets", ["--dataset", "rows.csv", "--label-column", "y"], "files"),
    ("transformers", ["--dataset", "rows.csv", "--text-column", "t", "--label-column", "y", "--model", "hf:model"],
     "hf"),
])
def test_a_missing_extra_is_one_line_naming_what_to_install(module, argv, extra, tmp_path, monkeypatch, capsys):
    if module == "transformers":
        pytest.importorskip("datasets")  # its CSV is read through datasets, which must be there for the refusal tested
    monkeypatch.chdir(tmp_path)
    Path("rows.csv").write_text("x,t,y\n0.5,good,1\n-0.5,bad,0\n0.25,fine,1\n")
    Path("model").mkdir()
    for file in ("config.json", "tokenizer.json"):
        Path("model", file).write_text("{}")

    def import_module(name: str):
        if name == module:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return importlib.import_module(name)

    monkeypatch.setattr(extras, "importlib", SimpleNamespace(import_module=import_module))  # as if not installed
    monkeypatch.setattr(tabular, "_r_file", lambda package, file: tmp_path / file)  # the R data, found
    with pytest.raises(SystemExit) as e:
        main(["train", *argv, "--epochs", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("dpopt: error: ") and f"needs the {module} package: pip install 'dpopt[{extra}]'" in err
