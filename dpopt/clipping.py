"""Stage 3 (clip): bound every example's contribution, then form the clipped sum.

The clip stage is the only place where sensitivity is established. ``Clipping.sensitivity`` is the L2
bound on one example's contribution to the sum under add/remove neighbours (twice that under replace-one,
which the accountant applies); every mode below guarantees it.

* ``flat`` — g_i * min(1, C / ||g_i||) over all parameters together.
* ``per-layer`` — each layer (the module owning a parameter) clipped to C / sqrt(L), L layers, so the
  concatenation has norm <= C.
* ``automatic`` — g_i * C / (||g_i|| + stability) (Bu et al., "Automatic clipping", 2023): every example
  normalised, norm < C.

An example whose norm is not finite gets weight 0 and contributes nothing (its non-finite entries are zeroed where
they are summed, without leaving the device); it is counted (and ``dpopt train`` warns). A negative squared norm is
an error, never a weight. ``clip_and_sum`` keeps what it learns on the device while it weighs (``Weighing``: the
lowest squared norm, the counts, the finite losses, and the flags the statistic adds, such as ghost norms that
cancelled) and reads it all in one host synchronisation per call; a negative squared norm is refused after that
read, before the sums are returned, so nothing is released before the check.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from dpopt.data.buckets import Padding

CLIP_MODES = ("flat", "per-layer", "automatic")


@dataclass(frozen=True)
class Clipping:
    """Stage 3's bound on each example's contribution (the module docstring has the modes' formulas); its
    ``sensitivity`` is the bound C under every mode.

    :param bound: the clip bound C (finite, > 0).
    :param mode: ``flat`` (all parameters together), ``per-layer`` (each layer to C / sqrt(L)) or ``automatic``
        (every example normalised: Bu et al. 2023).
    :param stability: automatic clipping's term in g * C / (||g|| + stability) (> 0).
    :raises ValueError: for a bound that is not a finite number > 0, an unknown mode, or automatic clipping with
        stability <= 0.
    """

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
        """The L2 bound on one example's contribution to the clipped sum, under add-remove neighbours: C."""
        return float(self.bound)

    def weights(self, sq_norms: torch.Tensor, groups: list[int],
                check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-example, per-parameter weights [B, P] (flat and automatic: one column, expanded) and the mask of
        examples with finite norms [B]. A negative squared norm is refused: norms are sums of squares, so it can
        only be a numerical failure, and turning it into a weight would hide it. ``check=False``
        leaves that check to the caller (which must make it before anything is released: ``clip_and_sum`` does,
        after its one read, and raises instead of returning the sums these weights formed)."""
        sq_norms = _nan_as_inf(sq_norms)
        if check:
            _refuse_negative(float(_lowest(sq_norms)))
        return self._weights(sq_norms, groups)

    def _weights(self, sq_norms: torch.Tensor, groups: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``weights`` of squared norms in which no entry is NaN (``_nan_as_inf``), unchecked."""
        if self.mode == "per-layer":
            group = _group_index(tuple(groups), sq_norms.device)
            n_groups = max(groups) + 1
            per_group = sq_norms.new_zeros(sq_norms.shape[0], n_groups).index_add_(1, group, sq_norms)
            finite = (per_group < math.inf).all(1)
            # min(1, C / sqrt(L) / ||g_l||) as rsqrt(||g_l||^2) C / sqrt(L): a zero norm gives inf, then 1
            w = per_group.rsqrt().mul_(self.bound / math.sqrt(n_groups)).clamp_(max=1.0)[:, group]
            return torch.where(finite.unsqueeze(1), w, 0.0), finite
        sq = sq_norms.sum(1)
        finite = sq < math.inf
        if self.mode == "flat":
            w = sq.rsqrt().mul_(self.bound).clamp_(max=1.0)  # min(1, C / ||g||); a zero norm gives inf, then 1
        else:
            w = self.bound / (sq.sqrt() + self.stability)
        # an infinite norm (a NaN one included) gives weight 0
        return w.unsqueeze(1).expand_as(sq_norms), finite


def _nan_as_inf(sq_norms: torch.Tensor) -> torch.Tensor:
    """``sq_norms`` with NaN as +inf: an example of NaN norm is one of infinite norm (weight 0, not finite), and
    the lowest entry is found by a plain minimum."""
    return sq_norms.nan_to_num(math.inf, math.inf, -math.inf)


def _lowest(sq_norms: torch.Tensor) -> torch.Tensor:
    """The smallest entry of ``sq_norms`` (``_nan_as_inf``: no NaN), 0 for none, on the device: negative if any
    is."""
    if not sq_norms.numel():
        return sq_norms.new_zeros(())
    return sq_norms.amin()


def _refuse_negative(lowest: float) -> None:
    """Raise if ``lowest`` (``_lowest`` of the squared norms, read) is negative."""
    if lowest < 0:
        raise FloatingPointError(f"a per-example squared norm is negative ({lowest:.3e}): the norm "
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
    losses: tuple[float, int] | None = None  # sum and count of the finite per-example losses (for display)


def loss_totals(losses: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """[sum, count] of the finite entries of ``losses`` in float64, on the device (an entry is finite where zeroing
    the non-finite ones leaves it equal); with ``real`` (a [B] 0/1 mask), of the real rows only (padding counts
    nowhere)."""
    finite_values = losses.nan_to_num(0.0, 0.0, 0.0)
    counted = finite_values == losses
    if real is not None:
        finite_values, counted = finite_values * real, counted * real
    return torch.stack([finite_values, counted]).sum(1, dtype=torch.float64)


class Weighing:
    """The ``weigh`` of one clip call: clip weights from squared norms (``Clipping.weights``), with what the clip
    stage reports and checks kept on the device (per call: the lowest squared norm, the finite examples and those
    weighted below 1; once: the finite losses' sum and count) until ``read`` takes it, with the flags a statistic
    adds, in one host synchronisation.

    ``real`` (a [B] 0/1 float mask on the device) marks a padded batch's examples: a padding row (0) gets weight 0
    and counts nowhere (not in the counts, the losses or the clipped count), so that a batch padded to a fixed
    size releases what the batch alone releases. The calls cover the batch's rows in order, from the first
    (``PerExampleStatistic.clipped_sum``), which is how each call finds its rows of the mask."""

    def __init__(self, clipping: Clipping, groups: list[int], losses: torch.Tensor | None = None,
                 real: torch.Tensor | None = None) -> None:
        self.clipping, self.groups, self.real = clipping, groups, real
        # of each call, not read yet: the lowest squared norm, the finite examples and those weighted below 1, and
        # with padding the finite rows ([1] each)
        self._calls: list[torch.Tensor] = []
        self._width = 3 if real is None else 4
        self._losses = None if losses is None else loss_totals(losses, real)  # [sum, count], not read yet
        self._layout = (0, False)  # of the last ``status``: its calls, and whether it holds the losses
        self.lowest, self.finite, self.below, self.finite_rows, self.rows = 0.0, 0, 0, 0, 0
        self.losses: tuple[float, int] | None = None

    def __call__(self, sq_norms: torch.Tensor) -> torch.Tensor:
        sq_norms = _nan_as_inf(sq_norms)
        w, finite = self.clipping._weights(sq_norms, self.groups)
        n = sq_norms.shape[0]
        if self.real is not None:
            real = self.real[self.rows:self.rows + n]  # this call's rows: those after the rows weighed so far
            w = w * real.unsqueeze(1)
            self._calls.append(finite.sum().reshape(1))  # every row's, padding included: whether to sanitize
            finite = finite * real
        self.rows += n
        smallest = w[:, 0] if w.stride(1) == 0 else w.amin(1)  # one weight per example (flat) or per part
        below = smallest < 1 if self.real is None else (smallest < 1) * real
        self._calls += [_lowest(sq_norms).reshape(1), finite.sum().reshape(1), below.sum().reshape(1)]
        return w

    @property
    def every_row_finite(self) -> bool:
        """Whether every row weighed and read so far has a finite norm (padding included): then no sum needs its
        non-finite entries zeroed."""
        return self.finite_rows == self.rows

    def restart(self) -> None:
        """Forget the calls so far, read or not (their squared norms are being recomputed)."""
        self._calls = []
        self.lowest, self.finite, self.below, self.finite_rows, self.rows = 0.0, 0, 0, 0, 0

    def stats(self, examples: int) -> ClipStats:
        """What the reads so far counted, for a batch of ``examples`` real examples; a negative squared norm is
        refused here, before any sum formed with these weights is used."""
        _refuse_negative(self.lowest)
        nonfinite = examples - self.finite
        return ClipStats(examples, nonfinite, self.below - nonfinite, self.losses)

    def read(self, flags: Sequence[torch.Tensor] = ()) -> list[float]:
        """What is not read yet and ``flags`` (1-d tensors, concatenated) in one host synchronisation (none if there
        is nothing to read); returns the flags' values."""
        status = self.status(flags)
        return [] if status is None else self.take(status.tolist())

    def status(self, flags: Sequence[torch.Tensor] = ()) -> torch.Tensor | None:
        """What is not read yet and ``flags``, concatenated on the device (None if nothing): what ``read`` reads.
        A captured step (``dpopt.grad.graphs``) forms it inside the capture and reads it after each replay; ``take``
        then counts its values."""
        parts = [*self._calls, *([] if self._losses is None else [self._losses]), *flags]
        self._layout = (len(self._calls), self._losses is not None)
        self._calls, self._losses = [], None
        return None if not parts else parts[0] if len(parts) == 1 else torch.cat(parts)

    def take(self, values: list[float]) -> list[float]:
        """Count the values of the last ``status`` (read on the host); returns the flags' values."""
        calls, has_losses = self._layout
        calls, k, rest = values[:calls], self._width, values[calls:]
        self.lowest = min([self.lowest, *calls[k - 3::k]])
        self.finite += int(sum(calls[k - 2::k]))
        self.below += int(sum(calls[k - 1::k]))
        self.finite_rows += int(sum(calls[0::k])) if self.real is not None else int(sum(calls[1::k]))
        if has_losses:
            (total, count), rest = rest[:2], rest[2:]
            self.losses = (total, int(count))
        return rest


class PerExampleStatistic(Protocol):
    """What the clip stage needs of a batch's per-example statistics: per-example gradients
    (``PerExampleGradients``) or any other per-example vectors, e.g. zeroth-order scalars."""

    batch_size: int
    groups: list[int]  # per-layer clipping: the group of each statistic tensor

    def sq_norms(self) -> torch.Tensor: ...  # [B, P]: squared norm of each example's part in each tensor

    def weighted_sum(self, weights: torch.Tensor, release: bool = False) -> list[torch.Tensor]: ...
    # sum_i w_i g_i per tensor; release: the statistic may free its storage as it goes (used once)

    def clipped_sum(self, weigh: Weighing | Callable[[torch.Tensor], torch.Tensor], release: bool = False,
                    into: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """sum_i w_i g_i with w = ``weigh``(squared norms of a set of rows) [n, P], called once for every
        example, added to the running sums ``into`` if given. This default weighs the whole batch at once; a
        statistic that forms per-example vectors a chunk of examples at a time may weigh each chunk as it is
        formed, to sum the same vectors, and one whose norms carry flags (``Weighing.read``) may read them before
        it sums."""
        sums = self.weighted_sum(weigh(self.sq_norms()), release)
        return sums if into is None else [a.add_(b) for a, b in zip(into, sums)]


def clip_and_sum(grads: PerExampleStatistic, clipping: Clipping, release: bool = False,
                 into: list[torch.Tensor] | None = None,
                 padding: Padding | None = None) -> tuple[list[torch.Tensor], ClipStats]:
    """The clipped sum sum_i clip(g_i) per parameter (``clipped_sum``, weights from ``Weighing``); ``release``
    lets the statistic free its per-example storage while summing (the private step's use). What the weighing kept
    on the device (and the statistic's per-example losses) is read once, by the statistic before it sums or here
    after; a negative squared norm is refused before the sums are returned. ``padding``: the batch's last rows are
    padding (``dpopt.data.buckets``), of weight 0 and counted nowhere."""
    examples, real = grads.batch_size, None
    if padding is not None:
        examples, real = padding.examples, padding.mask
    weigh = Weighing(clipping, grads.groups, getattr(grads, "losses", None), real)
    sums = grads.clipped_sum(weigh, release, into)
    weigh.read()  # a host synchronisation unless the statistic read everything already
    return sums, weigh.stats(examples)

