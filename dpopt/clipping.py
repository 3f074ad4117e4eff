"""Stage 3 (clip): bound every example's contribution, then form the clipped sum.

The clip stage is the only place where sensitivity is established. ``Clipping.sensitivity`` is the L2
bound on one example's contribution to the sum under add/remove neighbours (twice that under replace-one,
which the accountant applies); every mode below guarantees it.

* ``flat`` — g_i * min(1, C / ||g_i||) over all parameters together.
* ``per-layer`` — each layer (the module owning a parameter) clipped to C / sqrt(L), L layers, so the
  concatenation has norm <= C.
* ``automatic`` — g_i * C / (||g_i|| + stability) (Bu et al., "Automatic clipping", 2023): every example
  normalised, norm < C.

An example whose norm is not finite gets weight 0 and contributes nothing; it is counted (and ``dpopt train``
warns). A negative squared norm is an error, never a weight. ``clip_and_sum`` keeps the counts and the
negative-norm check on the device while it weighs (once per chunk of examples, which may be once per layer) and
reads them once, before it returns the sums: one host synchronisation per call, and nothing is released before
the check.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

CLIP_MODES = ("flat", "per-layer", "automatic")


@dataclass(frozen=True)
class Clipping:
    bound: float
    mode: str = "flat"
    stability: float = 0.01

    def __post_init__(self) -> None:
        if not (isinstance(self.bound, (int, float)) and math.isfinite(self.bound) and self.bound > 0):
            raise ValueError(f"the clip bound must be a finite number > 0, got {self.bound}")
        if self.mode not in CLIP_MODES:
            raise ValueError(f"unknown clipping mode {self.mode!r}; choose one of {', '.join(CLIP_MODES)}")
        if self.mode == "automatic" and not self.stability > 0:
            raise ValueError(f"automatic clipping needs stability > 0, got {self.stability}")

    @property
    def sensitivity(self) -> float:
        return float(self.bound)

    def weights(self, sq_norms: torch.Tensor, groups: list[int],
                check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-example, per-parameter weights [B, P] and the mask of examples with finite norms [B]. A negative
        squared norm is refused: norms are sums of squares, so it can only be a numerical failure, and turning
        it into a weight (NaN, then 0) would hide it. ``check=False`` leaves that check to the caller (which must
        make it before anything is released: ``clip_and_sum`` does, once per call instead of once per chunk, and
        raises instead of returning the sums these weights formed)."""
        if check:
            _refuse_negative(_lowest(sq_norms))
        if self.mode == "per-layer":
            group = _group_index(tuple(groups), sq_norms.device)
            n_groups = max(groups) + 1
            per_group = sq_norms.new_zeros(sq_norms.shape[0], n_groups).index_add_(1, group, sq_norms)
            norms = per_group.sqrt()
            finite = torch.isfinite(norms).all(1)
            w = (self.bound / math.sqrt(n_groups) / norms.clamp_min(1e-30)).clamp(max=1.0)[:, group]
        else:
            norms = sq_norms.sum(1).sqrt()
            finite = torch.isfinite(norms)
            if self.mode == "flat":
                w = (self.bound / norms.clamp_min(1e-30)).clamp(max=1.0)
            else:
                w = self.bound / (norms + self.stability)
            w = w.unsqueeze(1).expand_as(sq_norms)
        w = torch.where(finite.unsqueeze(1), w, torch.zeros_like(w))
        return w, finite


def _lowest(sq_norms: torch.Tensor) -> torch.Tensor:
    """The most negative entry of ``sq_norms``, or 0 if none is negative (NaN entries are not negative), on the
    device."""
    negative = torch.where(sq_norms < 0, sq_norms, sq_norms.new_zeros(()))
    return negative.min() if negative.numel() else negative.new_zeros(())


def _refuse_negative(lowest: torch.Tensor | float | None) -> None:
    """Raise if ``lowest`` (``_lowest`` of the squared norms) is negative (a host synchronisation)."""
    if lowest is not None and float(lowest) < 0:
        raise FloatingPointError(f"a per-example squared norm is negative ({float(lowest):.3e}): the norm "
                                 "computation lost precision; please report this model and statistic")


@functools.lru_cache(maxsize=64)
def _group_index(groups: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The per-layer group of each statistic tensor, on ``device``: copied there once, not on every call."""
    return torch.tensor(groups, device=device)


@dataclass(frozen=True)
class ClipStats:
    examples: int
    nonfinite: int
    clipped: int = 0  # finite examples scaled down (some weight < 1): their gradient norm exceeded the bound


class PerExampleStatistic(Protocol):
    """What the clip stage needs of a batch's per-example statistics: per-example gradients
    (``PerExampleGradients``) or any other per-example vectors, e.g. zeroth-order scalars."""

    batch_size: int
    groups: list[int]  # per-layer clipping: the group of each statistic tensor

    def sq_norms(self) -> torch.Tensor: ...  # [B, P]: squared norm of each example's part in each tensor

    def weighted_sum(self, weights: torch.Tensor, release: bool = False) -> list[torch.Tensor]: ...
    # sum_i w_i g_i per tensor; release: the statistic may free its storage as it goes (used once)

    def clipped_sum(self, weigh: Callable[[torch.Tensor], torch.Tensor], release: bool = False,
                    into: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """sum_i w_i g_i with w = ``weigh``(squared norms of a set of rows) [n, P], called once for every
        example, added to the running sums ``into`` if given. This default weighs the whole batch at once; a
        statistic that forms per-example vectors a chunk of examples at a time may weigh each chunk as it is
        formed, to sum the same vectors."""
        sums = self.weighted_sum(weigh(self.sq_norms()), release)
        return sums if into is None else [a.add_(b) for a, b in zip(into, sums)]


def clip_and_sum(grads: PerExampleStatistic, clipping: Clipping, release: bool = False,
                 into: list[torch.Tensor] | None = None) -> tuple[list[torch.Tensor], ClipStats]:
    """The clipped sum sum_i clip(g_i) per parameter (``clipped_sum``, weights from ``Clipping.weights``);
    ``release`` lets the statistic free its per-example storage while summing (the private step's use).
    ``weigh`` may be called once per chunk of examples: its counts and smallest squared norm stay on the device
    and are read once, at the end, where a negative squared norm is refused before the sums are returned."""
    totals: list[torch.Tensor] = []  # [smallest squared norm, non-finite, clipped] of each call, in float64

    def weigh(sq_norms: torch.Tensor) -> torch.Tensor:
        w, finite = clipping.weights(sq_norms, grads.groups, check=False)
        smallest = w[:, 0] if w.stride(1) == 0 else w.amin(1)  # one weight per example (flat) or per part
        totals.append(torch.stack([_lowest(sq_norms).double(), (~finite).sum().double(),
                                   ((smallest < 1) & finite).sum().double()]))
        return w

    sums = grads.clipped_sum(weigh, release, into)
    lowest, nonfinite, clipped = torch.stack(totals).T.tolist() if totals else ([], [0], [0])  # one synchronisation
    _refuse_negative(min(lowest, default=None))
    return sums, ClipStats(grads.batch_size, int(sum(nonfinite)), int(sum(clipped)))
