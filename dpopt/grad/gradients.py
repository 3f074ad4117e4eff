"""The per-example statistic: ``PerExampleGradients``, a lazy linear combination of captured per-example
gradients, with what the clip stage asks of it (per-example squared norms, weighted and clipped sums)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Collection, Iterable

import torch

from dpopt.clipping import PerExampleStatistic
from dpopt.grad.captures import (Capture, Combination, Dense, Outer, by_materializing, chunk_elements, chunks,
                                 coalesce, dense_sums, difference, inner_dense, sq_norms_of)

if TYPE_CHECKING:
    from dpopt.grad.engine import PerExampleEngine


BENIGN = 16
# ``clipped_sum``'s one pass over the materialised parameters works a chunk of examples at a time and, per chunk,
# every such parameter in turn: a chunk holds at least this many examples, or a model of many small parameters
# spends its step in per-call overhead (vit-tiny's two-point step: 3 examples a chunk at 2^20 elements; 12.5 ->
# 5.4 times PyTorch's CPU time, docs/performance.md). The pass needs 2 * per_example <= chunk_elements, so its
# temporaries stay under DIRECT_ROWS * chunk_elements (64 MB of float32 on a CPU).
DIRECT_ROWS = 16


def _weighted_rows(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """sum_i w_i g[i] over the rows of weight != 0 (a non-finite row given weight 0 contributes exactly zero):
    the other rows are replaced by zeros on the device, so no host synchronisation is needed to find them."""
    g = torch.where((w != 0).unsqueeze(1), g, g.new_zeros(()))
    return torch.tensordot(w.to(g.dtype), g, dims=1)


class PerExampleGradients(PerExampleStatistic):
    """Per-example gradients of a batch, as a linear combination of captured terms per parameter."""

    def __init__(self, engine: "PerExampleEngine", batch_size: int,
                 terms: list[list[tuple[float, Capture]]], losses: torch.Tensor | None = None) -> None:
        self.engine, self.batch_size, self.terms, self.losses = engine, batch_size, terms, losses
        self.shapes = engine.shapes
        self.released = False
        self._settled = False  # one-hot captures merged (``_settle``)
        # combined parameters whose terms may be summed apart (``sq_norms``): a flag on the device until ``_sums``
        # reads them all at once
        self._benign: dict[int, bool | torch.Tensor] = {}

    @property
    def groups(self) -> list[int]:
        return self.engine.groups

    @property
    def device(self) -> torch.device:
        return self.engine.params[0].device

    # --- linear combinations -------------------------------------------------------------------
    def _combine(self, other: "PerExampleGradients", a: float, b: float) -> "PerExampleGradients":
        self._check_alive()
        other._check_alive()
        if other.engine is not self.engine or other.batch_size != self.batch_size:
            raise ValueError("only per-example gradients of the same engine and batch can be combined")
        terms = [[(a * c, t) for c, t in mine] + [(b * c, t) for c, t in theirs]
                 for mine, theirs in zip(self.terms, other.terms)]
        return PerExampleGradients(self.engine, self.batch_size, terms, self.losses)

    def __add__(self, other: "PerExampleGradients") -> "PerExampleGradients":
        return self._combine(other, 1.0, 1.0)

    def __sub__(self, other: "PerExampleGradients") -> "PerExampleGradients":
        return self._combine(other, 1.0, -1.0)

    def __mul__(self, c: float) -> "PerExampleGradients":
        c = float(c)
        return PerExampleGradients(self.engine, self.batch_size,
                                   [[(c * k, t) for k, t in ts] for ts in self.terms], self.losses)

    __rmul__ = __mul__

    def __neg__(self) -> "PerExampleGradients":
        return self * -1.0

    # --- what the clip stage needs ---------------------------------------------------------------
    # A parameter with several terms (a combination, or a parameter used twice) is normed and summed from
    # its materialised per-example vectors, sum_k c_k G_k formed in float32 a chunk of examples at a time:
    # expanded into cross terms, its squared norm is a float sum that cancels below the true value when the
    # coefficients nearly cancel (DiSK's c = 43 at gamma = 0.01 and 1 - c; SRG's eta and -(eta - 1)), and
    # the clip bound is lost. One-hot captures are merged instead (``coalesce``): exact, and cheap; so are two
    # dense-factored ones whose coefficients differ in sign, rewritten as one capture in difference form
    # (``difference``) where its Gram route is cheaper than materialising. The sum of
    # a combined parameter is formed from the same materialised vectors too, unless its terms are benign for
    # every example: (sum_k |c_k| ||G_k||)^2 <= BENIGN * ||sum_k c_k G_k||^2 (no cancellation beyond a factor 4
    # in norm, as for DiSK's default c = 0.86, 1 - c, or SRG's g_t - 0.08 g_t-1). Then each term is summed by
    # book-keeping, whose float32 rounding is at most about 4u of the released norm, and the second
    # materialisation is saved.
    def _settle(self) -> None:
        if self._settled:
            return
        for j, ts in enumerate(self.terms):
            if ts and all(isinstance(t, Outer) and t.indexed for _, t in ts) and (len(ts) > 1 or ts[0][1].steps > 1):
                self.terms[j] = [(1.0, coalesce(ts))]
            elif (merged := difference(ts)) is not None:
                self.terms[j] = [(1.0, merged)]
        self._settled = True

    def _combined(self, j: int) -> bool:
        return len(self.terms[j]) > 1

    def _combination(self, j: int) -> Combination | None:
        """The combined parameter ``j`` as a ``Combination`` normed by the ghost identity, where its terms are
        dense-factored ``Outer`` captures for which that is cheaper; else None (normed from materialised vectors)."""
        ts = self.terms[j]
        if len(ts) < 2 or not all(type(t) is Outer and not t.indexed for _, t in ts):
            return None
        combination = Combination(ts)
        return combination if combination.by_ghost() else None

    def _materialized(self, j: int) -> bool:
        """Whether parameter ``j`` is normed from its materialised per-example vectors."""
        ts = self.terms[j]
        if self._combined(j):
            return self._combination(j) is None
        return bool(ts) and by_materializing(ts[0][1])

    def sq_norms(self, skip: Collection[int] = ()) -> torch.Tensor:
        """Squared per-example norms per parameter, [B, P] in float32; the columns of the parameters in
        ``skip`` are left zero."""
        self._check_alive()
        self._settle()
        wanted = [j for j, ts in enumerate(self.terms) if j not in skip and ts]
        combinations = {j: c for j in wanted if (c := self._combination(j)) is not None}
        captures = [t for j in wanted for _, t in self.terms[j]] + list(combinations.values())
        norms = iter(sq_norms_of(captures))  # the captures' norms, one host synchronisation for all of them
        of = {j: [next(norms) for _ in self.terms[j]] for j in wanted}
        combined = {j: next(norms) for j in combinations}
        cols = []
        for j, (p, ts) in enumerate(zip(self.engine.params, self.terms)):
            if j not in of:
                cols.append(torch.zeros(self.batch_size, device=p.device, dtype=torch.float32))
            elif self._combined(j):
                if j in combined:
                    sq = combined[j]
                else:
                    flats = (self._flat(j, s) for s in self._chunks(j))
                    sq = torch.cat([inner_dense(g, g) for g in flats])
                size = sum(abs(c) * n.sqrt() for (c, _), n in zip(ts, of[j])) ** 2
                self._benign[j] = (size <= BENIGN * sq).all()  # read in ``_sums``, with the others
                cols.append(sq)
            else:
                c, _ = ts[0]
                cols.append(of[j][0] if c == 1.0 else c * c * of[j][0])
        return torch.stack(cols, 1)

    def weighted_sum(self, weights: torch.Tensor, release: bool = False,
                     into: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """sum_i w_i g_i per parameter; ``weights`` is [B] or [B, P]. Examples of weight 0 are left out
        entirely, so a non-finite gradient given weight 0 contributes exactly zero. Parameters are summed
        last to first; ``release`` drops each parameter's captures as soon as its sum exists (the object is
        spent afterwards), so the sums of the first parameters — an embedding table's, say — are allocated
        when the other captures are already gone and the step's peak memory stays near a plain backward's.
        ``into``: running sums (a logical step's, over its physical batches) that each parameter's sum is added
        to as soon as it exists, so at most one parameter's sum is held besides them."""
        self._check_alive()
        self._settle()
        if weights.dim() == 1:
            weights = weights.unsqueeze(1).expand(-1, len(self.terms))
        sums = self._sums(weights, range(len(self.terms)), release, into)
        if release:
            self.released = True
        return sums

    def clipped_sum(self, weigh: Callable[[torch.Tensor], torch.Tensor], release: bool = False,
                    into: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """sum_i w_i g_i per parameter with weights w = ``weigh``(squared norms) [n, P], computed for rows of
        examples (the clip stage). The parameters normed from materialised per-example vectors (convolutions,
        combinations) are materialised once, a chunk of examples at a time, when they are small enough to be
        held together for a chunk: the chunk's norms complete its rows, ``weigh`` turns them into its weights,
        and the same vectors are summed with them at once. Otherwise norms and sums are two chunked passes."""
        self._check_alive()
        self._settle()
        direct = [j for j in range(len(self.terms)) if self._materialized(j)]
        per_example = sum(self.shapes[j].numel() for j in direct)
        if not direct or per_example > chunk_elements(self.device) // 2:
            return self.weighted_sum(weigh(self.sq_norms()), release, into)
        sq = self.sq_norms(skip=direct)
        sums: dict[int, torch.Tensor | None] = {j: None for j in direct}
        unflat = {j: self._unflat(j) for j in direct}
        weights = []
        for s in chunks(self.batch_size, 2 * per_example, self.device, DIRECT_ROWS):
            grads = {j: self._flat(j, s) for j in direct}
            for j, g in grads.items():
                sq[s, j] = inner_dense(g, g)
            w = weigh(sq[s])
            weights.append(w)
            for j, g in grads.items():
                part = _weighted_rows(w[:, j], g)
                sums[j] = part if sums[j] is None else sums[j].add_(part)
        if release:
            for j in direct:
                self.terms[j] = []
        out = self._sums(torch.cat(weights), [j for j in range(len(self.terms)) if j not in sums], release, into)
        for j, total in sums.items():
            total = unflat[j](total)
            out[j] = total if into is None else into[j].add_(total)
        if release:
            self.released = True
        return out

    def _chunks(self, j: int) -> list[slice]:
        return chunks(self.batch_size, 2 * self.shapes[j].numel(), self.device)

    def _flat(self, j: int, s: slice) -> torch.Tensor:
        """Per-example vectors sum_k c_k G_k of parameter ``j`` for the examples in ``s``, [n, numel] in float32
        at least, in its captures' shared ``flat_order`` (the parameter's own order if they differ)."""
        (c, t), *more = self.terms[j]
        own = len({t.flat_order for _, t in self.terms[j]}) > 1
        form = (lambda t: t.materialize(s).flatten(1)) if own else (lambda t: t.flat(s))
        g = form(t)
        g = g.to(self._sum_dtype(j)) * c if c != 1.0 or more or g.dtype != self._sum_dtype(j) else g
        for c, t in more:
            g.add_(form(t), alpha=c)
        return g

    def _unflat(self, j: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """Maps a [numel] sum in ``_flat``'s order to the parameter's (statistic's) shape."""
        ts = self.terms[j]
        if len({t.flat_order for _, t in ts}) == 1:
            return ts[0][1].unflat
        return lambda t: t.view(self.shapes[j])

    def _sum_dtype(self, j: int) -> torch.dtype:
        dtype = self.engine.params[j].dtype
        return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype

    def _sums(self, weights: torch.Tensor, params: Iterable[int], release: bool,
              into: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """``weighted_sum`` for the parameters in ``params`` (last to first), added to ``into`` if given; the
        others' entries are empty."""
        params = sorted(params, reverse=True)
        keep = (weights != 0).any(1)
        # one host synchronisation for the whole sum: whether rows are dropped, and which combined parameters
        # are benign (their flags, set by ``sq_norms``, are read here all at once)
        flagged = [j for j in params if isinstance(self._benign.get(j), torch.Tensor)]
        everyone, *benign = torch.stack([keep.all(), *(self._benign[j] for j in flagged)]).tolist()
        self._benign.update(zip(flagged, benign))
        rows = None if everyone else keep.nonzero().squeeze(1)
        sums: list[torch.Tensor] = [torch.empty(0)] * len(self.terms)
        # the parameters held as one dense capture (biases, norm layers' weights): summed together, a few products
        dense = [j for j in params if len(self.terms[j]) == 1 and isinstance(self.terms[j][0][1], Dense)]
        summed = dict(zip(dense, dense_sums([self.terms[j][0][1] for j in dense], [weights[:, j] for j in dense],
                                            rows)))
        for j in params:
            p, shape, ts = self.engine.params[j], self.shapes[j], self.terms[j]
            dtype = self._sum_dtype(j)
            w = weights[:, j] if rows is None else weights[rows, j]
            acc = None
            if self._combined(j) and not self._benign.get(j, False):
                unflat = self._unflat(j)
                for s in self._chunks(j):
                    part = _weighted_rows(weights[s, j], self._flat(j, s))
                    acc = part if acc is None else acc.add_(part)
                acc = unflat(acc)
            else:
                for c, t in ts if rows is None or rows.numel() else []:
                    part = summed[j] if j in summed else (t if rows is None else t.subset(rows)).weighted_sum(w)
                    part = part.to(dtype)  # a fresh tensor
                    if c != 1.0:
                        part.mul_(c)
                    acc = part if acc is None else acc.add_(part)
            if release:
                self.terms[j] = []
                del ts
            if into is not None:
                sums[j] = into[j] if acc is None else into[j].add_(acc.view(shape))
            else:
                sums[j] = torch.zeros(shape, device=p.device, dtype=dtype) if acc is None else acc.view(shape)
            del acc
        return sums

    def _check_alive(self) -> None:
        if self.released:
            raise RuntimeError("these per-example gradients were released by weighted_sum or clipped_sum "
                               "(release=True); compute them again")

    def materialize(self) -> list[torch.Tensor]:
        """Per-example gradients [B, *shape] per parameter (for tests and small models)."""
        self._check_alive()
        out = []
        for p, shape, ts in zip(self.engine.params, self.shapes, self.terms):
            acc = torch.zeros(self.batch_size, *shape, device=p.device, dtype=p.dtype)
            for c, t in ts:
                acc += c * t.materialize().reshape(acc.shape)
            out.append(acc)
        return out

