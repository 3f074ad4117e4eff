"""Checkpoints that are never half-written, and that carry the privacy ledger.

A checkpoint is written to a temporary file in the same folder, flushed to disk, and renamed over the
old one (an atomic replace on POSIX), so a crash at any instant leaves either the old or the new
checkpoint. A checkpoint holds the run's secret seed: it is for resuming, not for publishing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

CHECKPOINT = "checkpoint.pt"


class CheckpointError(RuntimeError):
    pass


def save_checkpoint(folder: str | os.PathLike, state: dict[str, Any]) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / CHECKPOINT
    tmp = folder / f".{CHECKPOINT}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return final


def load_checkpoint(folder: str | os.PathLike) -> dict[str, Any]:
    path = Path(folder) / CHECKPOINT
    if not path.is_file():
        raise CheckpointError(f"no checkpoint to resume from: {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: never resume from it
        raise CheckpointError(f"checkpoint {path} is corrupt or unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict) or state.get("format") != "dpopt-checkpoint-1":
        raise CheckpointError(f"{path} is not a dpopt checkpoint")
    return state
