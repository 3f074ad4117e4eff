"""Where a run computes (``--device``) and in what precision (``--precision``); see docs/design.md, "Devices and
precision".

The model's device is the run's device: batches are moved to it, and the engine, the clip stage and the noise
allocate there. Low precision is autocast around the forward (and so the backward) only: parameters, optimizer
state, norms, clipped sums and noise stay float32. fp16 runs with a fixed loss scale (``FP16_LOSS_SCALE``).
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import torch
from torch.utils._pytree import tree_map

DEVICES = ("cpu", "cuda", "mps", "auto")
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# fp16's loss scale: fixed, so that which steps overflow never changes how later steps are computed.
FP16_LOSS_SCALE = 2.0 ** 10


def add_device_arguments(p: argparse.ArgumentParser, device: str = "cpu", precision: str | None = None) -> None:
    """``--device`` (and ``--precision`` if it has a default); checked by ``dpopt.device``, which refuses bad
    values with one line (exit 2)."""
    p.add_argument("--device", default=device, metavar="|".join(DEVICES),
                   help="where the model, batches, clip stage and noise live; auto: cuda, else mps, else cpu")
    if precision is not None:
        p.add_argument("--precision", default=precision, metavar="|".join(PRECISIONS),
                       help="autocast forward and backward in bf16 (CPU or CUDA) or fp16 (CUDA only; fixed loss "
                            "scale); weights, optimizer state, norms, clipped sums and noise stay fp32")


def _available(kind: str) -> bool:
    return torch.cuda.is_available() if kind == "cuda" else kind == "cpu" or torch.backends.mps.is_available()


def resolve_device(name: str) -> torch.device:
    """``auto``: cuda if available, else mps if available, else cpu; refuses an unknown or absent device."""
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; choose one of {', '.join(DEVICES)}")
    if name == "auto":
        name = next(k for k in ("cuda", "mps", "cpu") if _available(k))
    if not _available(name):
        raise ValueError(f"device {name!r} was requested but this machine has none (torch sees no {name.upper()} "
                         "device); use --device cpu, or auto")
    return torch.device(name)


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The dtype the forward is autocast to on ``device`` (None: fp32, no autocast)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if precision == "fp16" and device.type != "cuda":
        raise ValueError(f"fp16 needs a CUDA device (this run is on {device.type}); use bf16 on CPU")
    return PRECISIONS[precision]


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype)


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of ``batch`` on ``device`` (asynchronously where the copy allows it)."""
    return tree_map(lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t, batch)


def rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The public RNG state that random operations (dropout) on ``device`` draw from: the CPU's, and CUDA's."""
    return torch.random.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.random.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
