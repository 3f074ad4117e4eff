"""Crash safety: runs killed with SIGKILL (mid-epoch, mid-write) resume to exactly the uninterrupted run;
checkpoints are never half-written and the ledger never loses or double-counts a step.

The full experiment (20 kills over four algorithms, through the CLI) is ``dpopt reproduce crash_safety``;
this is its small version: runs of a tiny model in child processes, killed at random instants."""

import random
import shutil

import pytest
import torch

from dpopt.algorithms import DiSKAdam
from dpopt.checkpoint import CHECKPOINT, CheckpointError, load_checkpoint, save_checkpoint
from dpopt.run import TrainConfig, resume, train
from dpopt.run import loop as train_module
from dpopt.run.state import checkpoint_state
from helpers import forkserver, quiet
from experiments.crash_safety import after_kill, same_run, watch

# RDP: cheap epsilons; disk-adam: optimizer and transform state both have to survive a crash. A secret
# seed (replayable noise) makes separately started runs comparable with their reference.
TINY = TrainConfig(algorithm="disk-adam", model="logreg", epochs=3, noise_multiplier=1.0, accountant="rdp",
                   secret_seed=0, hyperparameters=DiSKAdam(lr=0.01))


def _train_on_one_thread(config: TrainConfig, folder) -> None:
    """A child's run, forked from the forkserver, never from the suite's process (fork breaks autograd once CUDA's
    autograd threads exist, as under the suite on a GPU machine): bitwise equality needs the reference's thread
    count."""
    torch.set_num_threads(1)
    train(config, folder, progress=False, log=quiet)


@pytest.fixture
def one_thread():
    """Bitwise equality needs the same thread count in every process."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (checkpointing after every step), on one thread: what every resumed run must equal,
    whatever its checkpoint frequency."""
    folder, before = tmp_path_factory.mktemp("crash") / "reference", torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        metrics = train(TrainConfig(**{**TINY.__dict__, "checkpoint_every": 1}), folder, progress=False, log=quiet)
    finally:
        torch.set_num_threads(before)
    return folder, metrics


def test_sigkill_at_random_instants_then_resume_is_exact(tmp_path, one_thread, reference):
    config = TrainConfig(**{**TINY.__dict__, "checkpoint_every": 1})
    rng = random.Random(0)
    cut_writes = 0
    for i in range(3):
        folder = tmp_path / f"killed{i}"
        child = forkserver().Process(target=_train_on_one_thread, args=(config, folder))
        child.start()
        seen = watch(child, folder, kill_after_first=rng.uniform(0.0, 0.1))
        assert seen["killed"] and seen["returncode"] == -9
        assert seen["problems"] == []  # every checkpoint read while it ran was whole and consistent
        left = after_kill(folder)
        assert left["checkpoint_ok"], left
        cut_writes += bool(left["temp_files_left"])
        resume(folder, progress=False, log=quiet)
        assert not list(folder.glob(f".{CHECKPOINT}.*.tmp"))  # a cut write's leftovers are cleaned up
        same = same_run(folder, reference[0])
        assert same["parameters_bitwise_equal"] and same["epsilon_equal"] and same["ledger_equal"], same
        assert same["history_equal"] and same["final_consistent"] and same["ledger_steps_final"] == 33, same


def test_mid_epoch_checkpoints_every_n_steps_and_exact_resume(tmp_path, monkeypatch, one_thread, reference):
    config = TrainConfig(**{**TINY.__dict__, "checkpoint_every": 4})
    full_folder, full = reference  # checkpointing every step: how often a run checkpoints never changes it

    class Crash(Exception):
        pass

    written = []

    def save_then_crash_at_step_16(folder, state):
        save_checkpoint(folder, state)
        written.append((state["step"], len(state["epoch_losses"]), len(state["history"])))
        if state["step"] == 16:
            raise Crash

    monkeypatch.setattr(train_module, "save_checkpoint", save_then_crash_at_step_16)
    with pytest.raises(Crash):
        train(config, tmp_path / "cut", progress=False, log=quiet)
    # (step, losses of the epoch so far, evaluated epochs): every 4th step within an epoch of 11 steps,
    # and at the epoch's end, after its evaluation
    assert written == [(4, 4, 0), (8, 8, 0), (11, 0, 1), (12, 1, 1), (16, 5, 1)]
    monkeypatch.undo()
    resumed = resume(tmp_path / "cut", progress=False, log=quiet)
    assert resumed["history"] == full["history"]  # the epoch's partial losses survived the crash
    assert resumed["epsilon"] == full["epsilon"] and resumed["ledger"] == full["ledger"]
    a, b = load_checkpoint(full_folder), load_checkpoint(tmp_path / "cut")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_an_inconsistent_checkpoint_is_neither_written_nor_resumed(tmp_path, reference):
    shutil.copytree(reference[0], tmp_path, dirs_exist_ok=True)
    state = load_checkpoint(tmp_path)
    state["optimizer"]["steps"] += 1  # one step more than the ledger recorded
    save_checkpoint(tmp_path, state)
    with pytest.raises(CheckpointError, match="inconsistent"):
        resume(tmp_path, progress=False, log=quiet)
    run = train_module.build_run(TINY, log=quiet)
    run.optimizer.steps = 1
    with pytest.raises(RuntimeError, match="refusing to checkpoint"):
        checkpoint_state(run, [], 0.0, 0.0, [], 0)
