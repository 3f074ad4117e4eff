"""The training loop: a private run from a config, with progress, evaluation, checkpoints and resume.

A run is a function of its config and its secret key: the public seed drives initialisation, the secret
streams (keyed by 256 bits of OS entropy drawn at the start of the run, or by an explicit ``secret_seed``
for replayable noise; per-draw OS entropy in secure mode) drive sampling and noise, both counter-based. The
key is kept only in the checkpoint (private), so ``resume`` continues a run to exactly the parameters and
epsilon of an uninterrupted one; metrics.json and the exported model (``OUT/model``) never hold it.
A checkpoint is written at the end of every epoch and, with ``checkpoint_every = N``, after every N-th
step within an epoch, with the epoch's partial statistics, so a run killed at any instant loses at most N
steps and its resumed history (losses, evaluations) is the uninterrupted run's. With ``parallel`` (see
``dpopt.distributed``) the process is one rank of a data-parallel run: rank 0 logs and writes.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from dpopt.algorithms import NON_PRIVATE
from dpopt.checkpoint import check_writable, load_checkpoint, save_checkpoint
from dpopt.distributed import DataParallel
from dpopt.models import hf_folder
from dpopt.noise.rng import derive_seed
from dpopt.plan import mechanism
from dpopt.report import CURVES, LOG, TENSORBOARD, logging_to, plot_curves, tensorboard_writer
from dpopt.run.build import build_run
from dpopt.run.config import TrainConfig
from dpopt.export import MODEL_DIR, export_model
from dpopt.run.outputs import bar_epsilon, chance_warning, metrics_of, write_metrics
from dpopt.sharded import gathered
from dpopt.run.state import checkpoint_state, restore, saved_key, saved_steps_per_epoch
from dpopt.task import accuracy


def _silent(_: str) -> None:
    pass


def train(config: TrainConfig, out: str | Path | None = None, progress: bool = True,
          log: Callable[[str], None] = print, _resume_state: dict[str, Any] | None = None,
          parallel: DataParallel | None = None) -> dict[str, Any]:
    """Run (or, with ``_resume_state``, continue) a private training run; returns the metrics. With
    ``parallel`` this process is one rank of a data-parallel run; only rank 0 logs and writes to ``out``."""
    if parallel is not None and not parallel.lead:
        out, progress, log = None, False, _silent
    writer = None
    if out is not None:
        out = check_writable(out)
        log = logging_to(out / LOG, log)
        writer = tensorboard_writer(out / TENSORBOARD, None if _resume_state is None else _resume_state["step"] + 1)
        if writer is None:
            log("tensorboard is not installed: no TensorBoard events (pip install tensorboard)")
    if _resume_state is not None:
        log(f"resuming {config.algorithm} on {config.dataset} from step {_resume_state['step']}")
    run = build_run(config, log, parallel, None if _resume_state is None else saved_key(_resume_state))
    history: list[dict[str, Any]] = []
    losses: list[float] = []  # this epoch's step losses
    epoch_nonfinite = 0
    epoch_clipped = [0, 0]  # this epoch's clipped and clip-stage examples
    wall = cpu = 0.0
    if _resume_state is not None:
        restore(run, _resume_state)
        history = list(_resume_state["history"])
        losses = list(_resume_state.get("epoch_losses", []))
        epoch_nonfinite = int(_resume_state.get("epoch_nonfinite", 0))
        epoch_clipped = list(_resume_state.get("epoch_clipped", [0, 0]))
        wall, cpu = float(_resume_state["wall_time_s"]), float(_resume_state["cpu_time_s"])
    if parallel is not None and not run.sharded:  # sharded: every rank built the same model, then kept its shards
        parallel.broadcast_(run.optimizer.params)  # rank 0's starting point everywhere
    per_epoch, every = run.sampler.steps_per_epoch, config.checkpoint_every
    nonfinite = sum(h.get("nonfinite", 0) for h in history)
    start, cpu_start = time.perf_counter() - wall, time.process_time() - cpu
    while run.optimizer.steps < run.total_steps:
        epoch, done = divmod(run.optimizer.steps, per_epoch)
        bar = tqdm(initial=done, total=per_epoch, desc=f"epoch {epoch + 1}/{config.epochs}", disable=not progress,
                   leave=False, miniters=1)  # advanced by hand: an iterating bar's count lags its postfix's redraws
        for _ in range(done, per_epoch):
            torch.manual_seed(derive_seed(config.seed, "public", "step", run.optimizer.steps))  # dropout; not secret
            result = run.optimizer.step(run.data.train)
            epoch_nonfinite += result.nonfinite
            epoch_clipped = [epoch_clipped[0] + result.clipped, epoch_clipped[1] + result.examples]
            steps = run.optimizer.steps
            if result.loss is not None:
                losses.append(result.loss)
                if writer is not None:
                    writer.add_scalar("train/loss", result.loss, steps)
            if progress:
                bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.4f}" if losses else "-",
                                acc=f"{history[-1]['test_accuracy']:.4f}" if history else "-",
                                eps=bar_epsilon(run.ledger, config.delta), refresh=False)
                bar.update()
            if (out is not None or run.sharded) and every and steps % every == 0 and steps % per_epoch:  # epoch
                # ends: below. A sharded run's ranks all gather the state that rank 0 writes.
                state = checkpoint_state(run, history, time.perf_counter() - start, time.process_time() - cpu_start,
                                         losses, epoch_nonfinite, epoch_clipped)
                if out is not None:
                    save_checkpoint(out, state)
        bar.close()
        if epoch_nonfinite and (parallel is None or parallel.lead):
            warnings.warn(f"{epoch_nonfinite} examples had non-finite gradients in epoch {epoch + 1}; "
                          "they contributed zero to the update", stacklevel=2)
        nonfinite += epoch_nonfinite
        acc = accuracy(run.model, run.data.test, parallel=None if run.sharded else parallel)  # sharded: every
        # rank evaluates the whole test set, so that all run the same forwards (FSDP2's gathers are collective)
        eps = run.ledger.epsilon(config.delta)
        history.append({"epoch": epoch + 1, "step": run.optimizer.steps, "test_accuracy": acc, "epsilon": eps,
                        "train_loss": sum(losses) / max(1, len(losses)), "nonfinite": epoch_nonfinite,
                        "clipped_fraction": epoch_clipped[0] / max(1, epoch_clipped[1])})
        losses, epoch_nonfinite, epoch_clipped = [], 0, [0, 0]
        if out is not None or run.sharded:
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            state = checkpoint_state(run, history, wall, cpu, losses, epoch_nonfinite, epoch_clipped)
        if out is not None:
            save_checkpoint(out, state)
            write_metrics(out, metrics_of(run, history, nonfinite, wall, cpu, finished=False))
        if writer is not None:
            for key, value in history[-1].items():
                writer.add_scalar(f"eval/{key}", value, run.optimizer.steps)
            writer.flush()  # on disk with the checkpoint, so that a resumed run continues them
        log(f"epoch {epoch + 1}/{config.epochs}: test accuracy {acc:.4f}, epsilon {eps:.4g}")
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    metrics = metrics_of(run, history, nonfinite, wall, cpu, finished=True)
    warning = chance_warning(run, history[-1])
    if warning is not None:
        metrics["warning"] = warning
        if parallel is None or parallel.lead:
            warnings.warn(warning, stacklevel=2)
    weights = gathered(run.model.state_dict()) if run.sharded else None  # every rank gathers, rank 0 writes
    if out is not None:
        write_metrics(out, metrics)
        export_model(run.model, Path(out, MODEL_DIR), hf_folder(config.model), weights)
        if plot_curves(history, out / CURVES) is None:
            log(f"matplotlib is not installed: no {CURVES} (pip install matplotlib)")
    if writer is not None:
        writer.close()
    log(metrics["privacy_statement"])
    return metrics


def extended(config: TrainConfig, epochs: int | None, steps_per_epoch: int) -> TrainConfig:
    """``config`` run to ``epochs`` (None: as it is) when resuming. Extending keeps the noise calibrated for the
    original length, so the extra steps spend more privacy (the ledger accounts for every one); correlated noise
    is built for a fixed number of steps and cannot be extended (the refusal names the run's mechanism, which
    depends on its ``config.epochs * steps_per_epoch`` steps)."""
    if epochs is None or epochs == config.epochs:
        return config
    if epochs < config.epochs:
        raise ValueError(f"--epochs {epochs} is below the run's {config.epochs}: a resumed run can be extended, "
                         "not shortened")
    if not config.schedule.is_constant:
        raise ValueError(f"a run with a learning-rate schedule ({config.lr_schedule}, warm-up {config.warmup}) is "
                         f"set by its {config.epochs} epochs and cannot be extended; start a new run")
    if config.algorithm not in NON_PRIVATE and config.noise_kind != "gaussian":
        kind = mechanism(config, config.epochs * steps_per_epoch)
        raise ValueError(f"{kind} noise is built for the run's {config.epochs} epochs and cannot be "
                         f"extended to {epochs}; start a new run")
    return dataclasses.replace(config, epochs=epochs, calibration_epochs=config.calibration_epochs or config.epochs)


def resume(out: str | Path, progress: bool = True, log: Callable[[str], None] = print,
           parallel: DataParallel | None = None, epochs: int | None = None,
           state: dict[str, Any] | None = None) -> dict[str, Any]:
    """Continue the run whose checkpoint is in ``out`` to its configured end, or to ``epochs`` (see ``extended``;
    with ``parallel``, rank 0 reads the checkpoint and sends it to the other ranks). ``state``: that checkpoint,
    where the caller has read it already (the CLI, to check the flags), so it is not read and held twice."""
    read = (lambda: load_checkpoint(out)) if state is None else (lambda: state)
    state = read() if parallel is None else parallel.from_lead(read)
    saved = TrainConfig.from_dict(state["config"])
    config = extended(saved, epochs, saved_steps_per_epoch(state))
    if config is not saved and (parallel is None or parallel.lead):
        log(f"extending the run from {saved.epochs} to {epochs} epochs: the noise stays as calibrated for "
            f"{config.calibration_epochs} epochs, so epsilon grows past the target with every extra step "
            "(the ledger accounts for each)")
    return train(config, out, progress, log, _resume_state=state, parallel=parallel)
