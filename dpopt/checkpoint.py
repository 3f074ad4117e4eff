"""Checkpoints that are never half-written, and that carry the privacy ledger.

A checkpoint is written to a temporary file in the same folder, flushed to disk, and renamed over the
old one (an atomic replace on POSIX), so a crash at any instant leaves either the old or the new
checkpoint; a temporary file left by a killed writer is removed by the next write. The same holds for
``write_atomic`` (metrics.json). A checkpoint holds the run's secret key: it is for resuming, not for
publishing. ``claim_run_folder`` checks an output folder before a run starts.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, IO

import torch

CHECKPOINT = "checkpoint.pt"
FORMAT = "dpopt-checkpoint-1"


class CheckpointError(RuntimeError):
    pass


def write_atomic(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> Path:
    """Write ``path`` through ``write(file)`` so that it holds either its old or its complete new content."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".{final.name}.*.tmp"):  # left by a writer that was killed
        stale.unlink(missing_ok=True)
    tmp = final.parent / f".{final.name}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    dir_fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return final


def check_writable(folder: str | os.PathLike) -> Path:
    """Create ``folder`` if needed and check that a file can be written in it, before any work is done."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ValueError(f"cannot write to the output folder {folder}: {e.strerror or e}") from None
    return folder


def claim_run_folder(folder: str | os.PathLike, files: tuple[str, ...], overwrite: bool = False,
                     hint: str = "") -> Path:
    """Check ``folder`` for a new run that writes ``files``: one already there means an existing run, refused
    unless ``overwrite`` (which removes them; nothing else in the folder is touched); ``hint`` ends the refusal.
    The folder must be writable."""
    folder = Path(folder)
    old = [name for name in files if (folder / name).exists()]
    if old and not overwrite:
        raise ValueError(f"{folder} already holds a run ({', '.join(old)}); {hint}replace it with --overwrite, "
                         "or choose another --out")
    check_writable(folder)
    for name in old:
        path = folder / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return folder


def save_checkpoint(folder: str | os.PathLike, state: dict[str, Any]) -> Path:
    return write_atomic(Path(folder) / CHECKPOINT, lambda f: torch.save(state, f))


def load_checkpoint(folder: str | os.PathLike) -> dict[str, Any]:
    path = Path(folder) / CHECKPOINT
    if not path.is_file():
        raise CheckpointError(f"no checkpoint to resume from: {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: never resume from it
        raise CheckpointError(f"checkpoint {path} is corrupt or unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a dpopt checkpoint")
    return state
