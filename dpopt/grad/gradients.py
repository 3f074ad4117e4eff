"""The per-example statistic: ``PerExampleGradients``, a lazy linear combination of captured per-example
gradients, with what the clip stage asks of it (per-example squared norms, weighted and clipped sums).

In the clip stage (``clipped_sum``) nothing waits for the device but one read, once the weights exist and before
the sums: the clip stage's own counts (``Weighing.read``) with the flags its norms raise (ghost norms that may have
cancelled, combined parameters whose terms cancel). The rare example whose ghost norm cancelled is then recomputed
exactly, at the cost of two more reads (which examples; their new weighing). Rows of weight 0 (non-finite norms) are
summed as zeros: where the read says every norm is finite, the sums skip that zeroing."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Collection, Iterable

import torch

from dpopt.clipping import PerExampleStatistic, Weighing
from dpopt.grad.captures import (Capture, Combination, Dense, Outer, Pending, _cat, _zeroed, by_materializing,
                                 cancelled, chunk_elements, chunks, coalesce, dense_sums, difference, inner_dense,
                                 outer_runs, outer_sums, resolve, sq_norms_of)

if TYPE_CHECKING:
    from dpopt.grad.engine import PerExampleEngine


BENIGN = 16
# ``clipped_sum``'s one pass over the materialised parameters works a chunk of examples at a time and, per chunk,
# every such parameter in turn: a chunk holds at least this many examples, or a model of many small parameters
# spends its step in per-call overhead (vit-tiny's two-point step: 3 examples a chunk at 2^20 elements; 12.5 ->
# 5.4 times PyTorch's CPU time, docs/performance.md). The pass needs 2 * per_example <= chunk_elements, so its
# temporaries stay under DIRECT_ROWS * chunk_elements (64 MB of float32 on a CPU).
DIRECT_ROWS = 16


def _weighted_rows(w: torch.Tensor, g: torch.Tensor, sanitize: bool = True) -> torch.Tensor:
    """sum_i w_i g[i]: with ``sanitize`` a non-finite row (given weight 0) contributes exactly zero, its entries
    zeroed on the device (``_zeroed``), so no host synchronisation is needed to find it."""
    return torch.tensordot(w.to(g.dtype), _zeroed(g, sanitize=sanitize), dims=1)


def _read(weigh: Weighing | Callable[[torch.Tensor], torch.Tensor], flags: list[torch.Tensor]) -> list[float]:
    """``flags`` read on the host: with the clip stage's counts (one synchronisation for both) where ``weigh`` is a
    ``Weighing``, even without flags; else only where there are flags."""
    if isinstance(weigh, Weighing):
        return weigh.read(flags)
    return torch.cat(flags).tolist() if flags else []


class PerExampleGradients(PerExampleStatistic):
    """Per-example gradients of a batch, as a linear combination of captured terms per parameter."""

    def __init__(self, engine: "PerExampleEngine", batch_size: int,
                 terms: list[list[tuple[float, Capture]]], losses: torch.Tensor | None = None) -> None:
        self.engine, self.batch_size, self.terms, self.losses = engine, batch_size, terms, losses
        self.shapes = engine.shapes
        self.released = False
        self.recheck: torch.Tensor | None = None  # see ``clipped_sum(static=True)``
        self._settled = False  # one-hot captures merged (``_settle``)
        # combined parameters whose terms may be summed apart (``_columns``): a flag on the device until it is read
        # with the others
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
    # materialisation is saved. An example of non-finite norm is left out of this test: its weight is 0.
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
        ``skip`` are left zero. Exact: examples whose ghost norms cancelled are recomputed (one host synchronisation
        where some capture's steps could cancel)."""
        self._check_alive()
        self._settle()
        pending: Pending = []
        norms = self._capture_norms(skip, pending)
        resolve(pending)
        return self._columns(*norms)

    def _capture_norms(self, skip: Collection[int],
                       pending: Pending) -> tuple[dict[int, list[torch.Tensor]], dict[int, torch.Tensor]]:
        """The squared norms [B] of every term of the parameters not in ``skip``, and of the combined ones, with the
        ghost norms that may have cancelled appended to ``pending`` (``sq_norms_of``)."""
        wanted = [j for j, ts in enumerate(self.terms) if j not in skip and ts]
        combinations = {j: c for j in wanted if (c := self._combination(j)) is not None}
        captures = [t for j in wanted for _, t in self.terms[j]] + list(combinations.values())
        norms = iter(sq_norms_of(captures, pending))
        of = {j: [next(norms) for _ in self.terms[j]] for j in wanted}
        combined = {j: next(norms) for j in combinations}
        for j in wanted:
            if self._combined(j) and j not in combined:
                combined[j] = torch.cat([inner_dense(g, g) for g in (self._flat(j, s) for s in self._chunks(j))])
        return of, combined

    def _columns(self, of: dict[int, list[torch.Tensor]], combined: dict[int, torch.Tensor],
                 zero: bool = True) -> torch.Tensor:
        """[B, P] from ``_capture_norms``' norms (for the parameters it skipped: zero, or with ``zero=False`` unset, for
        a caller that writes them), and whether each combined parameter is benign (a flag set on the device)."""
        cols = []
        for j, (p, ts) in enumerate(zip(self.engine.params, self.terms)):
            if j not in of:
                fill = torch.zeros if zero else torch.empty
                cols.append(fill(self.batch_size, device=p.device, dtype=torch.float32))
            elif self._combined(j):
                sq = combined[j]
                size = sum(abs(c) * n.sqrt() for (c, _), n in zip(ts, of[j])) ** 2
                self._benign[j] = ~(size > BENIGN * sq).any()  # NaN (weight 0) is not above
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

    def clipped_sum(self, weigh: Weighing | Callable[[torch.Tensor], torch.Tensor], release: bool = False,
                    into: list[torch.Tensor] | None = None, static: bool = False) -> list[torch.Tensor]:
        """sum_i w_i g_i per parameter with weights w = ``weigh``(squared norms) [n, P], computed for rows of
        examples (the clip stage). The parameters normed from materialised per-example vectors (convolutions,
        combinations) are materialised once, a chunk of examples at a time, when they are small enough to be
        held together for a chunk: the chunk's norms complete its rows, ``weigh`` turns them into its weights,
        and the same vectors are summed with them at once. Otherwise norms and sums are two chunked passes.
        A ``Weighing`` is read (its counts, with the flags the norms raise) once the weights exist, before the other
        parameters are summed: where every example's norm is finite (the common case) no sum zeroes non-finite
        entries; where one is not, the sums of the materialised parameters are formed again with the zeroing (a
        rare second pass) and the others are formed with it. If a ghost norm cancelled, its examples are recomputed
        (a second read: which ones), everything is weighed again (read by the clip stage) and the combined
        parameters are summed from materialised vectors, zeroing non-finite entries. Another ``weigh`` (a plain
        function) reads only the flags, where there are any, and every sum zeroes non-finite entries.

        ``static``: nothing is read (a step that can be captured and replayed: ``dpopt.grad.graphs``). Every sum zeroes
        non-finite entries, combined parameters are summed as if benign, and ``recheck`` is left on the device: [1],
        above 0 where a ghost norm may have cancelled or a combined parameter is not benign (None: no such doubt). The
        caller reads it with the weighing's counts and, where it is above 0, forms the sums again without ``static``:
        those were wrong."""
        self._check_alive()
        self._settle()
        direct = [j for j in range(len(self.terms)) if self._materialized(j)]
        if sum(self.shapes[j].numel() for j in direct) > chunk_elements(self.device) // 2:
            direct = []
        pending: Pending = []
        norms = self._capture_norms(direct, pending)
        counted = isinstance(weigh, Weighing) and not static  # its read tells whether every norm is finite
        weights, sums = self._weigh(weigh, self._columns(*norms, zero=False), direct, sanitize=not counted)
        flagged = [j for j, f in self._benign.items() if isinstance(f, torch.Tensor)]
        flags = [torch.stack([self._benign[j] for j in flagged])] if flagged else []
        if static:
            doubts = ([cancelled(pending)] if pending else []) + [(~f).sum(dtype=torch.float64).reshape(1) for f in flags]
            self.recheck = sum(doubts[1:], doubts[0]) if doubts else None
            recompute, benign = 0, [True] * len(flagged)
        else:
            recompute, *benign = _read(weigh, [cancelled(pending), *flags]) if pending else [0, *_read(weigh, flags)]
        sanitize = not counted
        if recompute:
            resolve(pending)
            if counted:
                weigh.restart()
            weights, sums = self._weigh(weigh, self._columns(*norms, zero=False), direct, sanitize=True)
            benign = [False] * len(flagged)  # summed from materialised vectors: exact, and nothing to read
            sanitize = True
        elif counted and not weigh.every_row_finite:  # a non-finite row, of weight 0: summed as zeros
            sums = {j: self._materialized_sum(weights, j) for j in direct}
            sanitize = True
        self._benign.update(zip(flagged, map(bool, benign)))
        unflat = {j: self._unflat(j) for j in direct}
        if release:
            for j in direct:
                self.terms[j] = []
        out = self._sums(weights, [j for j in range(len(self.terms)) if j not in sums], release, into, sanitize)
        for j, total in sums.items():
            total = unflat[j](total)
            out[j] = total if into is None else into[j].add_(total)
        if release:
            self.released = True
        return out

    def _weigh(self, weigh: Callable[[torch.Tensor], torch.Tensor], sq: torch.Tensor, direct: list[int],
               sanitize: bool = True) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The weights [B, P] from ``sq`` (its ``direct`` columns still unset), and the sums [numel] of the ``direct``
        parameters: their per-example vectors materialised a chunk of examples at a time, normed into ``sq`` and
        summed with the chunk's weights at once (non-finite entries zeroed with ``sanitize``)."""
        if not direct:
            return weigh(sq), {}
        per_example = sum(self.shapes[j].numel() for j in direct)
        sums: dict[int, torch.Tensor] = {}
        weights = []
        for s in chunks(self.batch_size, 2 * per_example, self.device, DIRECT_ROWS):
            grads = {j: self._flat(j, s) for j in direct}
            for j, g in grads.items():
                inner_dense(g, g, out=sq[s, j])
            w = weigh(sq[s])
            weights.append(w)
            for j, g in grads.items():
                part = _weighted_rows(w[:, j], g, sanitize)
                sums[j] = sums[j].add_(part) if j in sums else part
        return _cat(weights), sums

    def _materialized_sum(self, weights: torch.Tensor, j: int, sanitize: bool = True) -> torch.Tensor:
        """sum_i w_ij g_ij [numel] of parameter ``j`` in ``_flat``'s order, from its per-example vectors materialised
        a chunk of examples at a time (non-finite entries zeroed with ``sanitize``)."""
        acc = None
        for s in self._chunks(j):
            part = _weighted_rows(weights[s, j], self._flat(j, s), sanitize)
            acc = part if acc is None else acc.add_(part)
        return acc

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
              into: list[torch.Tensor] | None = None, sanitize: bool = True) -> list[torch.Tensor]:
        """``weighted_sum`` for the parameters in ``params`` (last to first), added to ``into`` if given; the
        others' entries are empty. Every row is summed (with ``sanitize``, one of weight 0 as zeros; without, the
        caller knows every row to be finite): no host synchronisation, but to read the flags of combined parameters
        that nothing has read yet (``weighted_sum`` after ``sq_norms``)."""
        params = sorted(params, reverse=True)
        flagged = [j for j in params if isinstance(self._benign.get(j), torch.Tensor)]
        if flagged:
            self._benign.update(zip(flagged, map(bool, torch.stack([self._benign[j] for j in flagged]).tolist())))
        sums: list[torch.Tensor] = [torch.empty(0)] * len(self.terms)
        # the parameters held as one dense capture (biases, norm layers' weights): summed together, a few products
        dense = [j for j in params if len(self.terms[j]) == 1 and isinstance(self.terms[j][0][1], Dense)]
        summed = dict(zip(dense, dense_sums([self.terms[j][0][1] for j in dense], [weights[:, j] for j in dense],
                                            sanitize)))
        # the Linear layers' terms summed by book-keeping: those of equal shapes together (``outer_sums``), each run
        # when its first parameter is reached, so that sums appear about as captures are dropped (a run's sums, at
        # most ``chunk_elements`` for its factors and sums together, ahead)
        materialized = {j for j in params if self._combined(j) and not self._benign.get(j, False)}
        book = [(j, i) for j in params if j not in materialized
                for i, (_, t) in enumerate(self.terms[j]) if type(t) is Outer and not t.indexed]
        runs = {book[run[0]]: [book[k] for k in run]
                for run in outer_runs([self.terms[j][i][1] for j, i in book])}
        ready: dict[tuple[int, int], torch.Tensor] = {}
        for j in params:
            p, shape, ts = self.engine.params[j], self.shapes[j], self.terms[j]
            dtype = self._sum_dtype(j)
            acc = None
            if j in materialized:
                acc = self._unflat(j)(self._materialized_sum(weights, j, sanitize))
            else:
                for i, (c, t) in enumerate(ts):
                    if (j, i) in runs:
                        run = runs[(j, i)]
                        ready.update(zip(run, outer_sums([self.terms[a][b][1] for a, b in run],
                                                         [weights[:, a] for a, _ in run], sanitize)))
                    part = summed[j] if j in summed else ready.pop((j, i)) if (j, i) in ready else \
                        t.weighted_sum(weights[:, j], sanitize)
                    part = part.to(dtype)
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

    def parameter(self, j: int, s: slice = slice(None)) -> torch.Tensor:
        """Per-example gradients [n, *shape] of parameter ``j`` for the examples in ``s``, in its dtype."""
        self._check_alive()
        p, shape = self.engine.params[j], self.shapes[j]
        acc = torch.zeros(len(range(self.batch_size)[s]), *shape, device=p.device, dtype=p.dtype)
        for c, t in self.terms[j]:
            acc.add_(t.materialize(s).reshape(acc.shape), alpha=c)
        return acc

    def materialize(self) -> list[torch.Tensor]:
        """Per-example gradients [B, *shape] per parameter (for tests and small models; ``parameter`` gives one)."""
        return [self.parameter(j) for j in range(len(self.terms))]

