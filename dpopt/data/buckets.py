"""Static batch shapes: a sampled batch padded to one of a few sizes with rows of weight zero.

Poisson sampling draws a batch of a different size every step; a step captured once and replayed (a CUDA graph)
needs one shape. ``bucket_size`` rounds a batch of n examples up to a multiple of a granularity set by the
expected batch (an eighth of it, or twice its standard deviation under Poisson sampling if that is more: a power of
two), at most the physical batch size, so a run sees a few shapes and wastes at most about an eighth of a large
batch; ``pad`` appends copies of the batch's first example. The clip stage gives the padding rows weight 0 and
counts them nowhere (``clipping.Weighing``), so a padded batch releases exactly what the batch alone releases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def granularity(expected: float) -> int:
    """The step between two bucket sizes for an expected batch of ``expected`` examples: the largest power of two
    at most max(expected / 8, 2 sqrt(expected)): a Poisson batch's standard deviation is sqrt(expected), so a few
    steps cover its sizes, and a large batch wastes at most an eighth."""
    return 1 << max(0, math.floor(math.log2(max(expected / 8, 2 * math.sqrt(max(expected, 1.0))))))


def bucket_size(n: int, expected: float, physical: int | None = None) -> int:
    """The padded size of a (physical) batch of ``n`` examples: ``n`` rounded up to a multiple of
    ``granularity``, at most ``physical`` (the physical batch size, whose batches are never larger).

    :param n: the batch's examples (>= 1).
    :param expected: the expected logical batch size (the sampler's normaliser).
    :param physical: the physical batch size, or None.
    :returns: the size to pad to, >= n.
    """
    step = granularity(expected if physical is None else min(expected, physical))
    size = -(-n // step) * step
    return size if physical is None else max(n, min(size, physical))


@dataclass(frozen=True)
class Padding:
    """The padding of one batch: its ``examples`` real rows come first, then padding rows; ``mask`` is 1 on the
    examples and 0 on the padding, one float per row, on the model's device.

    :param examples: the real examples.
    :param mask: [rows] float: 1 for an example, 0 for padding.
    """

    examples: int
    mask: torch.Tensor

    @classmethod
    def of(cls, examples: int, rows: int, device: torch.device | str = "cpu") -> "Padding":
        """The padding of a batch of ``rows`` rows whose first ``examples`` are real."""
        mask = torch.ones(rows, device=device)
        if examples < rows:
            mask[examples:] = 0.0
        return cls(examples, mask)


def pad(index: torch.Tensor, size: int) -> torch.Tensor:
    """``index`` (a batch's example indices, non-empty) padded to ``size`` rows with copies of its first example.

    :param index: the batch's indices, [n] with 1 <= n <= size.
    :param size: the padded size.
    :returns: the padded indices [size].
    :raises ValueError: for an empty index or one longer than ``size``.
    """
    n = index.numel()
    if not 1 <= n <= size:
        raise ValueError(f"cannot pad a batch of {n} examples to {size} rows")
    return index if size == n else torch.cat([index, index[:1].expand(size - n)])
