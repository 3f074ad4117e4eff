"""A statistic as one flat buffer: per-tensor views of one 1-D tensor, so that an element-wise stage (noise,
division, a collective) is one operation over the buffer instead of one per tensor (on a GPU, one kernel launch
instead of one per parameter)."""

from __future__ import annotations

from typing import Sequence

import torch


def views(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Consecutive views of the 1-D ``flat`` with the given shapes (their sizes add up to its length)."""
    return [v.view(s) for v, s in zip(flat.split([s.numel() for s in shapes]), shapes)]


def zeros(shapes: Sequence[torch.Size], dtype: torch.dtype, device: torch.device | str) -> list[torch.Tensor]:
    """Zero tensors of the given shapes: views of one flat buffer (``flat_view`` recovers it)."""
    shapes = [torch.Size(s) for s in shapes]
    return views(torch.zeros(sum(s.numel() for s in shapes), dtype=dtype, device=device), shapes)


def flat_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D tensor that ``tensors`` (the non-empty ones) are consecutive contiguous views of (one dtype,
    one storage); None if they are not (e.g. separate tensors)."""
    parts = [t for t in tensors if t.numel()]
    if not parts:
        return None
    first = parts[0]
    storage, start = first.untyped_storage().data_ptr(), first.storage_offset()
    end = start
    for t in parts:
        if (t.dtype != first.dtype or t.device != first.device or not t.is_contiguous() or t.storage_offset() != end
                or t.untyped_storage().data_ptr() != storage):
            return None
        end += t.numel()
    return first.as_strided((end - start,), (1,), start)
