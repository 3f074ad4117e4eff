"""A run's checkpoint state: what is saved, and the checks before a run is restored from it."""

from __future__ import annotations

from typing import Any

import torch

from dpopt.checkpoint import CheckpointError
from dpopt.data.samplers import sampler_state
from dpopt.privacy import PrivacyLedger
from dpopt.run.build import Run
from dpopt.sharded import gathered, load_model_state


def checkpoint_state(run: Run, history: list[dict[str, Any]], wall: float, cpu: float, epoch_losses: list[float],
                     epoch_nonfinite: int, epoch_clipped: tuple[int, int] | list[int] = (0, 0)) -> dict[str, Any]:
    """A checkpoint: model, optimizer, ledger, sampler and RNG state, and the current epoch's partial statistics
    (a sharded run's gathered on rank 0, the unsharded run's format; the other ranks take part and keep nothing).
    The secret streams and the sampler are counter-based (their state is the run's secret key plus the next
    step: the key makes the checkpoint private); the public torch generator is re-seeded every step and is
    saved as well."""
    steps = run.optimizer.steps
    if run.ledger.steps != steps:
        raise RuntimeError(f"refusing to checkpoint: the ledger holds {run.ledger.steps} releases but the "
                           f"optimizer took {steps} steps")
    model = gathered(run.model.state_dict()) if run.sharded else run.model.state_dict()
    return {"format": "dpopt-checkpoint-1", "config": run.config.to_dict(), "model": model,
            "optimizer": run.optimizer.state_dict(),
            "ledger": run.ledger.to_dict(), "step": steps, "sampler": sampler_state(run.sampler, steps),
            "rng": {"torch": torch.get_rng_state(), "secret_next_step": steps, "secure": run.config.secure,
                    "secret_key": run.secret_key},
            "history": history, "wall_time_s": wall, "cpu_time_s": cpu,
            "epoch_losses": list(epoch_losses), "epoch_nonfinite": epoch_nonfinite,
            "epoch_clipped": list(epoch_clipped)}


def saved_key(state: dict[str, Any]) -> int | bytes | None:
    """The secret key a checkpoint holds; refuses one written before keys were (its noise came from the
    public seed), since resuming it with a new key would not continue the same run."""
    if "secret_key" not in state.get("rng", {}):
        raise CheckpointError("the checkpoint holds no secret key (an older dpopt wrote it and derived the noise "
                              "from the public seed); start a new run")
    return state["rng"]["secret_key"]


def check_complete(state: dict[str, Any]) -> None:
    """Refuse a checkpoint written before its sampler, RNG state and CPU time were recorded."""
    missing = {"sampler", "rng", "cpu_time_s"} - set(state)
    if missing:
        raise CheckpointError(f"the checkpoint lacks {', '.join(sorted(missing))} (an older dpopt wrote it); "
                              "start a new run")


def saved_steps_per_epoch(state: dict[str, Any]) -> int:
    """The steps per epoch of the run a checkpoint holds (what ``extended`` names its noise by)."""
    check_complete(state)
    return state["sampler"]["steps_per_epoch"]


def restore(run: Run, state: dict[str, Any]) -> None:
    """Load a checkpoint into a freshly built run; refuses one that this config does not rebuild exactly."""
    check_complete(state)
    if run.sharded:
        load_model_state(run.model, state["model"])
    else:
        run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    run.ledger.entries = PrivacyLedger.from_dict(state["ledger"]).entries
    if run.ledger.steps != run.optimizer.steps:
        raise CheckpointError(f"checkpoint is inconsistent: the ledger holds {run.ledger.steps} releases but "
                              f"the optimizer took {run.optimizer.steps} steps; do not resume from it")
    if state["sampler"] != sampler_state(run.sampler, run.optimizer.steps):
        raise CheckpointError(f"the checkpoint's sampler {state['sampler']} differs from the one this run builds "
                              f"{sampler_state(run.sampler, run.optimizer.steps)}: the dataset or the sampling "
                              "changed since the checkpoint was written; start a new run")
    torch.set_rng_state(state["rng"]["torch"])
