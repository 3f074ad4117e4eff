"""Per-example gradients of one parameter, held in the cheapest form, and the algebra on them.

A ``Capture`` is what one use of one parameter in one forward/backward contributed to every example's
gradient. Two forms:

* ``Dense`` — the per-example gradients themselves, ``g[i]`` of the parameter's shape.
* ``Outer`` — a sum of outer products per example, G_i = sum_t left[i, t] (x) right[i, t], which is how
  Linear, Conv (unfolded) and Embedding gradients arise. ``left`` may be an index tensor (the rows an
  Embedding looked up), meaning one-hot vectors. Never materialised unless that is cheaper.

Three operations are all every clipping rule and every algorithm needs: ``sq_norms(c)`` (per-example squared
norms; for an ``Outer`` capture by the ghost-norm identity ||L^T R||^2 = sum_ts (L L^T)_ts (R R^T)_ts where
that is cheaper than materialising), ``weighted_sum(w)`` (sum_i w_i G_i in one contraction: the book-keeping
trick) and ``materialize()``. Linear combinations of captures (two-point statistics) are never expanded into
unguarded cross terms, whose float sum can cancel below the true norm: a ``Combination`` of dense-factored
captures takes the Gram route under the cancellation guard (its cancelled examples recomputed from their
materialised combination), ``coalesce`` merges one-hot captures, and ``PerExampleGradients`` materialises the
rest. Low-precision captures are normed, summed and materialised in float32.

On an accelerator each operation is a kernel launch, and a private step is bound by their count: captures of one
kind are normed together (``sq_norms_of``: the Gram matrices of all Linear-like captures of equal steps in one
buffer, dense ones stacked by size) and summed together (``dense_sums``; ``outer_sums`` for Linear layers of equal
shapes), with no copy for a single chunk, and one-hot captures are merged with static shapes and no host
synchronisation (``coalesce``). Nothing depends on the data's values up to the clip stage's one read: a weighted sum
zeroes the non-finite entries of its rows (those of weight 0) instead of leaving the rows out, or, where the clip
stage has read that every example's norm is finite, sums the rows as they are (``sanitize``); which ghost norms
cancelled may be left pending (``sq_norms_of``) for the clip stage to read with its own counts (``resolve``), and
their rare exact recomputation follows that read.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import torch
import torch.nn.functional as F

# Per-example temporaries (Gram matrices, unfolded patches) are formed for chunks of examples holding at
# most this many elements: on a CPU 2^20 (4 MB of float32, cache-sized), so the clip stage needs a few MB on
# top of the captures; on an accelerator 2^24 (64 MB), where a chunk's kernel launches cost more than its
# memory (docs/performance.md, "On a GPU": a CNN b1024 step is 1,613 aten operations at 2^20, 478 at 2^24).
CHUNK_ELEMENTS = 1 << 20
ACCELERATOR_CHUNK_ELEMENTS = 1 << 24
# A ghost norm below 1/CANCELLING of its steps' own squared norms is recomputed exactly (``_ghost_sq_norms``).
CANCELLING = 16


def chunk_elements(device: torch.device) -> int:
    """The most elements a chunk's per-example temporaries may hold on ``device``."""
    return CHUNK_ELEMENTS if device.type == "cpu" else ACCELERATOR_CHUNK_ELEMENTS


def chunks(batch: int, per_example: int, device: torch.device, at_least: int = 1) -> list[slice]:
    """Slices of examples whose temporaries of ``per_example`` elements each fit in ``chunk_elements``, but of
    ``at_least`` examples."""
    size = max(at_least, chunk_elements(device) // max(1, per_example))
    return [slice(i, min(i + size, batch)) for i in range(0, batch, size)]


def check_version(t: torch.Tensor, version: int) -> None:
    """Captured activations alias the forward's tensors: refuse them if the model changed one in place."""
    if t._version != version:
        raise RuntimeError(
            "an activation captured for per-example gradients was modified in place after the layer used it; "
            "make that in-place operation out-of-place (e.g. x = x + y instead of x += y)")


def _f32(t: torch.Tensor) -> torch.Tensor:
    """Norms are accumulated in float32 at least, whatever the model's precision."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype ``_f32`` gives a tensor of ``dtype``."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _cat(parts: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat``, without the copy for a single part."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _runs(items: list[int], each: int, device: torch.device) -> list[list[int]]:
    """``items`` in runs whose temporaries, ``each`` elements per item, fit in ``chunk_elements`` together (one item
    a run where one alone does not): one batched operation per run instead of one per item."""
    size = max(1, chunk_elements(device) // max(1, each))
    return [items[i:i + size] for i in range(0, len(items), size)]


def _stacked(ts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Tensors of one shape stacked as one of ``dtype`` (one copy, casting included; none for a single tensor of
    ``dtype``)."""
    if len(ts) == 1:
        return ts[0].to(dtype).unsqueeze(0)
    return torch.stack(ts, out=ts[0].new_empty((len(ts), *ts[0].shape), dtype=dtype))


def _stacked_weights(ws: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Per-capture weights [B] as one [K, B] tensor of ``dtype``: ``_stacked``, or, where they are all one view (flat
    and automatic clipping: every column of the weights is the same one), that view expanded, without a copy."""
    first = ws[0]
    if all(w.data_ptr() == first.data_ptr() and w.stride() == first.stride() and w.shape == first.shape for w in ws):
        return first.to(dtype).unsqueeze(0).expand(len(ws), *first.shape)
    return _stacked(ws, dtype)


def _flat_stacked(gs: list[torch.Tensor]) -> torch.Tensor:
    """Per-example gradients [B, ...] of equal numel as one [K, B, numel] tensor in float32 at least."""
    return _stacked([g.reshape(g.shape[0], -1) for g in gs], _wide(gs[0].dtype))


class Capture:
    """Per-example gradients of one parameter (``shape``) for ``batch_size`` examples."""

    batch_size: int
    shape: torch.Size

    def materialize(self, s: slice = slice(None)) -> torch.Tensor:
        """The per-example gradients of the examples in ``s``, [n, *shape]."""
        raise NotImplementedError

    def flat(self, s: slice = slice(None)) -> torch.Tensor:
        """The per-example gradients of the examples in ``s`` as [n, numel], in the element order named by
        ``flat_order`` (``unflat`` maps a sum back): norms and weighted sums do not depend on the order, and a
        capture may have a faster one than the parameter's."""
        g = self.materialize(s)
        return g.reshape(g.shape[0], -1)

    @property
    def flat_order(self) -> Hashable:
        """Captures of one parameter with equal ``flat_order`` give ``flat`` in the same element order, so
        their flat gradients may be added or multiplied elementwise."""
        return type(self)

    def unflat(self, t: torch.Tensor) -> torch.Tensor:
        """A [numel] tensor in ``flat``'s order, in the parameter's shape."""
        return t.view(self.shape)

    def weighted_sum(self, w: torch.Tensor, sanitize: bool = True) -> torch.Tensor:
        """sum_i w_i G_i; with ``sanitize`` a row of weight 0 contributes exactly zero, its non-finite entries zeroed
        (``_zeroed``); without, the caller knows every row to be finite."""
        raise NotImplementedError

    def held_elements(self) -> int:
        raise NotImplementedError


class Dense(Capture):
    def __init__(self, g: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> None:
        self.shape = torch.Size(shape)
        self.batch_size = g.shape[0]
        self.g = g.reshape(self.batch_size, *self.shape)

    def materialize(self, s: slice = slice(None)) -> torch.Tensor:
        return self.g[s]

    def weighted_sum(self, w: torch.Tensor, sanitize: bool = True) -> torch.Tensor:
        """sum_i w_i g[i] (``Capture.weighted_sum``)."""
        return torch.tensordot(_f32(w), _zeroed(_f32(self.g), sanitize=sanitize), dims=1)

    def held_elements(self) -> int:
        return self.g.numel()



def _zeroed(t: torch.Tensor, inplace: bool = False, sanitize: bool = True) -> torch.Tensor:
    """``t`` with its non-finite entries 0, before a weighted sum: only an example of non-finite norm has any, and
    its weight is 0, so it then contributes exactly zero (0 * NaN would be NaN) without a host synchronisation to
    find and drop its rows. ``sanitize=False``: ``t`` itself, for a caller that knows every row to be finite (the
    clip stage, once it has read its count of finite norms: a kernel launch saved per factor)."""
    if not sanitize:
        return t
    return t.nan_to_num_(0.0, 0.0, 0.0) if inplace else t.nan_to_num(0.0, 0.0, 0.0)


def dense_sums(captures: list[Dense], weights: list[torch.Tensor], sanitize: bool = True) -> list[torch.Tensor]:
    """``captures[k].weighted_sum(weights[k])`` for every k (book-keeping sums of biases, norm layers' weights):
    sum_i w_k[i] g_k[i], float32 at least, as one batched product [K, 1, B] @ [K, B, numel] per run of captures of
    equal size. Each sum is in its capture's shape, in memory of its own (no capture's). ``sanitize``: as
    ``_zeroed``."""
    out: list[torch.Tensor | None] = [None] * len(captures)
    groups: dict[Hashable, list[int]] = {}
    for k, c in enumerate(captures):
        groups.setdefault((math.prod(c.shape), _wide(c.g.dtype), c.g.device, c.batch_size), []).append(k)
    for (numel, _, device, batch), items in groups.items():
        for run in _runs(items, batch * numel, device):
            g = _zeroed(_flat_stacked([captures[k].g for k in run]), sanitize=sanitize)
            w = _stacked_weights([weights[k] for k in run], g.dtype)
            for k, total in zip(run, torch.bmm(w.unsqueeze(1), g).squeeze(1)):
                out[k] = total.view(captures[k].shape)
    return out


def gram_cost(steps: int, other_steps: int, rows: int, cols: int) -> int:
    """Multiply-adds per example of <A, B> for dense-factored captures of ``steps`` and ``other_steps`` steps by
    their Gram matrices (``rows`` 0 where a left factor is indexed: its Gram matrix is a comparison)."""
    return steps * other_steps * (rows + cols)


def materializing_cost(steps: int, other_steps: int, rows: int, cols: int) -> int:
    """Multiply-adds per example of <A, B> by forming both gradients, rows x cols each."""
    return (steps + other_steps + 1) * rows * cols


class Outer(Capture):
    """G_i = sum_t left[i, t] (x) right[i, t], reshaped to ``shape`` (rows x cols elements).

    ``left`` is [B, T, rows] (float) or [B, T] (int64 row indices: one-hot rows); ``right`` is [B, T, cols].
    """

    def __init__(self, left: torch.Tensor, right: torch.Tensor, rows: int,
                 shape: torch.Size | tuple[int, ...]) -> None:
        self.left, self.right, self.rows = left, right, rows
        self.shape = torch.Size(shape)
        self.batch_size = right.shape[0]
        self.cols = right.shape[-1]
        if rows * self.cols != math.prod(self.shape):
            raise ValueError(f"factors {rows}x{self.cols} do not match parameter shape {tuple(self.shape)}")
        self._versions = (left._version, right._version)

    def check_unchanged(self) -> None:
        check_version(self.left, self._versions[0])
        check_version(self.right, self._versions[1])

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the layer computed in (its output gradient's)."""
        return self.right.dtype

    @property
    def indexed(self) -> bool:
        return not self.left.is_floating_point()

    @property
    def steps(self) -> int:
        return self.right.shape[1]

    def factors(self, s: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """(left, right) of the examples in ``s``."""
        return self.left[s], self.right[s]

    def factor_temporaries(self) -> int:
        """Elements per example that ``factors`` allocates (none: they are views)."""
        return 0

    def subset(self, rows: torch.Tensor) -> "Outer":
        return Outer(self.left[rows], self.right[rows], self.rows, self.shape)

    def materialize(self, s: slice = slice(None)) -> torch.Tensor:
        """In float32 at least: low-precision gradients rounded to their dtype could be normed up to 2^-9 below the
        gradients that ``weighted_sum`` adds up from the same factors, and the clip bound would be exceeded."""
        self.check_unchanged()
        left, right = self.left[s], _f32(self.right[s])
        b, t, n = right.shape
        if self.indexed:
            out = right.new_zeros(b, self.rows, n)
            out.scatter_add_(1, left.unsqueeze(-1).expand(b, t, n), right)
        else:
            out = torch.bmm(_f32(left).transpose(1, 2), right)
        return out.view(b, *self.shape)

    def weighted_sum(self, w: torch.Tensor, sanitize: bool = True) -> torch.Tensor:
        """sum_i w_i G_i by book-keeping (``Capture.weighted_sum``)."""
        self.check_unchanged()
        b, t, n = self.right.shape
        w = _f32(w).view(b, 1, 1)  # a low-precision factor times w is float32 (type promotion): no separate cast
        if self.indexed:
            scaled = _zeroed(self.right * w, True, sanitize).reshape(b * t, n)
            out = scaled.new_zeros(self.rows, n).index_add_(0, self.left.reshape(-1), scaled)
        elif self.left.shape[-1] <= n:  # rescale the smaller factor
            left = _zeroed(self.left * w, True, sanitize).reshape(b * t, self.rows)
            out = left.T @ _zeroed(_f32(self.right), sanitize=sanitize).reshape(b * t, n)
        else:
            right = _zeroed(self.right * w, True, sanitize).reshape(b * t, n)
            out = _zeroed(_f32(self.left), sanitize=sanitize).reshape(b * t, self.rows).T @ right
        return out.view(self.shape)

    def held_elements(self) -> int:
        return self.left.numel() + self.right.numel()

    @property
    def device(self) -> torch.device:
        """Where the per-example gradients are formed."""
        return self.right.device

    def materialized_elements(self) -> int:
        return self.batch_size * self.rows * self.cols

    def ghost_cost(self, other: "Outer") -> float:
        """Multiply-adds of the Gram route for <self, other> per example."""
        return gram_cost(self.steps, other.steps, 0 if self.indexed or other.indexed else self.rows, self.cols)

    def materialize_cost(self, other: "Outer") -> int:
        return materializing_cost(self.steps, other.steps, self.rows, self.cols)


class ConvOuter(Outer):
    """A Conv2d weight's per-example gradients kept as the layer's input and output gradient.

    Its factors are the unfolded input patches (k*k times larger than the input) and the output gradient;
    the patches are formed only per chunk of examples. The weighted sum is the convolution weight-gradient
    kernel on the rescaled output gradient; materialising is a batched product per chunk.
    """

    def __init__(self, x: torch.Tensor, g: torch.Tensor, kernel: tuple[int, int], stride: tuple[int, int],
                 dilation: tuple[int, int], padding: tuple[int, int], groups: int,
                 shape: torch.Size | tuple[int, ...]) -> None:
        self.x, self.g = x, g
        self.kernel, self.stride, self.dilation, self.padding, self.groups = kernel, stride, dilation, padding, groups
        self.shape = torch.Size(shape)
        self.batch_size, self.rows = g.shape[:2]
        self.cols = math.prod(self.shape) // self.rows
        self._versions = (x._version, g._version)
        cin = self.cols // math.prod(kernel)  # per group
        # the layout of ``_patches``: by phase where its runs (an output row) are at least half as long as the
        # channels-last ones (kw * C_in): about where the two took equal time on CPU, over 20 layer shapes
        self.by_phase = (dilation == (1, 1) and kernel[0] % stride[0] == 0 and kernel[1] % stride[1] == 0
                         and 2 * g.shape[3] >= kernel[1] * cin)

    def check_unchanged(self) -> None:
        check_version(self.x, self._versions[0])
        check_version(self.g, self._versions[1])

    @property
    def indexed(self) -> bool:
        return False

    @property
    def dtype(self) -> torch.dtype:
        return self.g.dtype

    @property
    def steps(self) -> int:
        return self.g.shape[2] * self.g.shape[3]

    def factor_temporaries(self) -> int:
        return self.steps * self.cols

    def factors(self, s: slice) -> tuple[torch.Tensor, torch.Tensor]:
        cols = F.unfold(self.x[s], self.kernel, dilation=self.dilation, padding=self.padding, stride=self.stride)
        return self.g[s].flatten(2).transpose(1, 2), cols.transpose(1, 2)

    def subset(self, rows: torch.Tensor) -> "ConvOuter":
        return ConvOuter(self.x[rows], self.g[rows], self.kernel, self.stride, self.dilation, self.padding,
                         self.groups, self.shape)

    def ghost_cost(self, other: "Outer") -> float:
        """The Gram route needs the unfolded input too, and its T x T Gram matrices cost more than the
        product that materialises the gradients for all but the smallest outputs: never taken."""
        return math.inf

    def _patches(self, s: slice) -> torch.Tensor:
        """The unfolded input of the examples in ``s`` per group, [n * groups, T, kh * kw * C_in/groups], as one
        copy of a strided view of the padded input whose contiguous runs are as long as the layout allows:

        * channels-last (C_in/groups innermost, in (kh, kw, C_in/groups) order): runs of kw * C_in/groups; in
          ``F.unfold``'s (C_in, kh, kw) order the same copy took 2.7-4x as long for the Tanh CNN's second layer;
        * by phase (``by_phase``: output positions innermost, a transposed view), for long enough output rows
          where the stride divides the kernel: the input split into its stride phases, x[c, s*a + p] -> [c, p, a],
          makes the window of tap kh = s*u + p over an output row contiguous (rows a = o + u of phase p);
          columns in the weight's (C_in/groups, kh, kw) order (the Tanh CNN's first layer: runs of 14, not 8)."""
        x = _f32(self.x[s])
        (kh, kw), (sh, sw), (dh, dw) = self.kernel, self.stride, self.dilation
        ph, pw = self.padding
        n, c = x.shape[0], x.shape[1] // self.groups
        oh, ow = self.g.shape[2:]
        if self.by_phase:  # pad to whole phases too
            eh, ew = -(x.shape[2] + 2 * ph) % sh, -(x.shape[3] + 2 * pw) % sw
            x = F.pad(x, (pw, pw + ew, ph, ph + eh)) if ph or pw or eh or ew else x
            a, b = x.shape[2] // sh, x.shape[3] // sw
            x = x.reshape(n, self.groups, c, a, sh, b, sw).permute(0, 1, 2, 4, 6, 3, 5).contiguous()
            s0, s1, s2, s3, s4, s5, s6 = x.stride()
            view = x.as_strided((n, self.groups, c, kh // sh, sh, kw // sw, sw, oh, ow),
                                (s0, s1, s2, s5, s3, s6, s4, s5, s6))
            return view.reshape(n * self.groups, self.cols, oh * ow).transpose(1, 2)
        x = F.pad(x, (pw, pw, ph, ph)) if ph or pw else x
        x = x.permute(0, 2, 3, 1).contiguous()  # [n, H, W, C]; free for one channel
        s0, s1, s2, s3 = x.stride()
        view = x.as_strided((n, self.groups, oh, ow, kh, kw, c),
                            (s0, c * s3, sh * s1, sw * s2, dh * s1, dw * s2, s3))
        return view.reshape(n * self.groups, oh * ow, self.cols)

    def flat(self, s: slice = slice(None)) -> torch.Tensor:
        """G_i U_i^T per example (and group) for the output gradient G_i and the unfolded input U_i, C_out
        first, then ``_patches``' column order. A chunk of examples at a time: even chunks whose unfolded input fits
        ``chunk_elements`` / 2 and, on a CPU, about half of what the capture holds, so materialising during
        backward adds little to the step's peak memory; their number does not change with the batch until the
        budget binds (a static step). On CPU faster than one grouped convolution with the batch folded into
        the groups (Rochette et al., 2019) in 10 of 12 measurements on the Tanh CNN's layers (up to 1.8x), about
        as fast in the other two (``dpopt reproduce conv_norm_cost``, three runs). In float32 at least, as
        ``Outer.materialize``."""
        self.check_unchanged()
        start, stop, _ = s.indices(self.batch_size)
        out = self.g.new_empty(stop - start, self.rows * self.cols, dtype=_wide(self.g.dtype))
        rows = self.rows // self.groups
        # chunks of the device's budget: an accelerator's (2^23 elements) holds the Tanh CNN's patches at b256 in
        # one chunk (two at b1024), 1.07-1.08x PyTorch's peak memory; a CPU's cache-sized budget also keeps the patches
        # under half of what the capture holds, in a number of chunks set by the per-example sizes (the same at
        # every batch, so a step's operations are)
        budget = chunk_elements(self.device) // 2
        count = math.ceil(self.batch_size * self.factor_temporaries() / budget)
        if budget < ACCELERATOR_CHUNK_ELEMENTS // 2:
            per_example = self.held_elements() // self.batch_size
            count = max(count, math.ceil(2 * self.factor_temporaries() / per_example))
        cuts = {k * self.batch_size // count for k in range(1, count)}  # count even chunks of the batch
        edges = [start, *sorted(c for c in cuts if start < c < stop), stop]
        for i, j in zip(edges, edges[1:]):
            grads = _f32(self.g[i:j]).reshape((j - i) * self.groups, rows, -1)
            torch.bmm(grads, self._patches(slice(i, j)), out=out[i - start:j - start].view(-1, rows, self.cols))
        return out

    @property
    def flat_order(self) -> Hashable:
        return ConvOuter, self.by_phase  # one parameter used at two input sizes may take both layouts

    def unflat(self, t: torch.Tensor) -> torch.Tensor:
        if self.by_phase:
            return t.view(*t.shape[:-1], *self.shape)
        kh, kw = self.kernel
        g = t.view(-1, self.rows, kh, kw, self.cols // (kh * kw)).permute(0, 1, 4, 2, 3)
        return g.contiguous().view(*t.shape[:-1], *self.shape)

    def materialize(self, s: slice = slice(None)) -> torch.Tensor:
        return self.unflat(self.flat(s))

    def weighted_sum(self, w: torch.Tensor, sanitize: bool = True) -> torch.Tensor:
        """``Capture.weighted_sum``; the input's non-finite entries are zeroed even without ``sanitize``: one that no
        window covers (a stride past the last pixel) leaves the norm finite, and the weight-gradient kernel may
        still spread it (an FFT algorithm, say)."""
        self.check_unchanged()
        g = _zeroed(self.g * _f32(w).view(-1, 1, 1, 1), True, sanitize)
        shape = (self.rows, self.x.shape[1] // self.groups, *self.kernel)
        return torch.nn.grad.conv2d_weight(_zeroed(_f32(self.x)), shape, g, stride=self.stride, padding=self.padding,
                                           dilation=self.dilation, groups=self.groups).view(self.shape)

    def held_elements(self) -> int:
        return self.x.numel() + self.g.numel()

    @property
    def device(self) -> torch.device:
        return self.g.device


def by_materializing(c: Capture) -> bool:
    """Whether the norm of ``c`` is computed from materialised per-example gradients: a dense-factored
    ``Outer`` capture whose ghost route costs more."""
    return isinstance(c, Outer) and not c.indexed and not c.ghost_cost(c) <= c.materialize_cost(c)


def _materialized_sq_norms(c: Outer) -> torch.Tensor:
    """||G_i||^2 from the per-example gradients, materialised a chunk of examples at a time."""
    parts = chunks(c.batch_size, 2 * c.rows * c.cols, c.device)
    return _cat([inner_dense(g, g) for g in map(c.flat, parts)])


def _self_grams(c: Outer, s: slice, out: torch.Tensor) -> None:
    """L L^T into out[0] and R R^T into out[1] ([n, T, T] each) for the examples in ``s``; an indexed L's Gram
    matrix compares its rows (one-hot rows: 1 where equal, else 0)."""
    left, right = c.factors(s)
    right = _f32(right)
    torch.bmm(right, right.transpose(1, 2), out=out[1])
    if c.indexed:
        torch.eq(left.unsqueeze(2), left.unsqueeze(1), out=out[0])
    else:
        left = _f32(left)
        torch.bmm(left, left.transpose(1, 2), out=out[0])


def _ghost_sq_norms(run: list[Outer]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Squared norms [K, B] of K captures of T steps each by the ghost identity
    ||sum_t l_t (x) r_t||^2 = <L L^T, R R^T> = sum_ts (L L^T)_ts (R R^T)_ts, and the mask [K, B] of the examples
    to recompute from their materialised gradients (``sq_norms_of``); None for one step, whose norm is the product
    of two sums of squares, D itself: nothing to cancel. The float32 sum carries a rounding error of
    about u * D, D = sum_t ||l_t||^2 ||r_t||^2 (the steps' own squared norms: the Gram matrices' diagonals
    multiplied; u = 2^-24), small beside the norm unless the steps cancel: the examples whose ghost norm is under
    D / ``CANCELLING`` (or negative) are masked, so the error stays about ``CANCELLING`` * u relative. The Gram
    matrices of all K captures are written into one buffer, so each reduction is one operation for the run."""
    first = run[0]
    t = first.steps
    sq, own = [], []
    for s in chunks(first.batch_size, len(run) * (first.factor_temporaries() + 3 * t * t), first.device):
        n = len(range(*s.indices(first.batch_size)))
        grams = first.right.new_empty((2, len(run), n, t, t), dtype=_wide(first.right.dtype))
        for k, c in enumerate(run):
            _self_grams(c, s, grams[:, k])
        # one step: the Gram matrices are the factors' squared norms, and the norm is their product
        sq.append((grams[0] * grams[1]).view(len(run), n) if t == 1 else
                  torch.linalg.vecdot(grams[0].flatten(2), grams[1].flatten(2)))
        if t > 1:
            own.append(torch.linalg.vecdot(grams[0].diagonal(dim1=2, dim2=3), grams[1].diagonal(dim1=2, dim2=3)))
    norms = _cat(sq, 1)
    return norms, norms * CANCELLING < _cat(own, 1) if own else None


def _gram_dot(la: torch.Tensor, ra: torch.Tensor, lb: torch.Tensor,
              rb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """<G_a, G_b> = sum_ts (L_a L_b^T)_ts (R_a R_b^T)_ts per example (float32) for dense factors, and sum_t of the
    two Gram matrices' diagonals multiplied: for a = b, D, the steps' own squared norms."""
    gram = torch.bmm(_f32(ra), _f32(rb).transpose(1, 2))
    left_gram = torch.bmm(_f32(la), _f32(lb).transpose(1, 2))
    own = torch.linalg.vecdot(left_gram.diagonal(dim1=1, dim2=2), gram.diagonal(dim1=1, dim2=2))
    return _pairwise_dot(left_gram, gram), own


class Combination(Capture):
    """sum_k c_k G_k for dense-factored ``Outer`` captures of one parameter (a two-point statistic: DiSK's
    mixture, SRG's difference). Normed by the ghost identity over every pair of terms where that is cheaper than
    materialising, with the cancellation guard of a single capture (``_ghost_sq_norms``) over all the terms'
    steps together: an example whose terms or steps cancel is recomputed from its materialised combination."""

    def __init__(self, terms: list[tuple[float, Outer]]) -> None:
        self.terms = terms
        first = terms[0][1]
        self.shape, self.batch_size, self.rows, self.cols = first.shape, first.batch_size, first.rows, first.cols

    @property
    def steps(self) -> int:
        return sum(t.steps for _, t in self.terms)

    @property
    def device(self) -> torch.device:
        return self.terms[0][1].device

    def check_unchanged(self) -> None:
        for _, t in self.terms:
            t.check_unchanged()

    def by_ghost(self) -> bool:
        """Whether the pairwise Gram route (``Outer.ghost_cost`` of every pair of terms) costs less than
        materialising the combination, (sum of the terms' steps + 1) * rows * cols."""
        ghost = sum(a.ghost_cost(b) for _, a in self.terms for _, b in self.terms)
        return ghost <= (self.steps + 1) * self.rows * self.cols

    def materialize(self, s: slice = slice(None)) -> torch.Tensor:
        (c, t), *more = self.terms
        g = _f32(t.materialize(s)) * c
        for c, t in more:
            g.add_(_f32(t.materialize(s)), alpha=c)
        return g

    def subset(self, rows: torch.Tensor) -> "Combination":
        return Combination([(c, t.subset(rows)) for c, t in self.terms])


def _combination_sq_norms(c: Combination) -> tuple[torch.Tensor, torch.Tensor]:
    """||sum_k c_k G_k||^2 = sum_ab c_a c_b <L_a L_b^T, R_a R_b^T> per example, and the mask of the examples
    whose value is under D / ``CANCELLING``, D = sum_k c_k^2 sum_t ||l_kt||^2 ||r_kt||^2 (as ``_ghost_sq_norms``)."""
    out, own = [], []
    for s in chunks(c.batch_size, 3 * c.steps * c.steps, c.device):
        factors = [(k, *map(_f32, t.factors(s))) for k, t in c.terms]
        sq = d = None
        for a, (ka, la, ra) in enumerate(factors):
            for b, (kb, lb, rb) in enumerate(factors[a:], a):
                dot, diag = _gram_dot(la, ra, lb, rb)
                part = dot * (ka * kb * (1.0 if a == b else 2.0))
                sq = part if sq is None else sq.add_(part)
                if a == b:
                    d = diag * ka * ka if d is None else d.add_(diag, alpha=ka * ka)
        out.append(sq)
        own.append(d)
    sq = _cat(out)
    return sq, sq * CANCELLING < _cat(own)


def _recompute(c: Outer | Combination, sq: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: the squared norms of the examples ``rows`` (indices) from their materialised gradients."""
    g = c.subset(rows).materialize()
    sq[rows] = inner_dense(g, g)


def _pairwise_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum over all but the first dimension of a * b (operands are chunk-sized: a product temporary is fine,
    and 4x faster on CPU than a batched matrix product)."""
    n = a.shape[0]
    return torch.linalg.vecdot(a.reshape(n, -1), b.reshape(n, -1))


def inner_dense(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-example inner products of two [n, ...] tensors, in float32 at least; written into ``out`` ([n], a
    column of a larger tensor, say) if given."""
    a, b = _f32(a), _f32(b)
    if out is None or out.dtype != torch.promote_types(a.dtype, b.dtype):
        dot = _pairwise_dot(a, b)
        return dot if out is None else out.copy_(dot)
    n = a.shape[0]
    return torch.linalg.vecdot(a.reshape(n, -1), b.reshape(n, -1), out=out)


def sq_norms(c: Capture) -> torch.Tensor:
    """Per-example squared norms ||G[i]||^2 (float32, shape [B]): sums of squares, or the ghost identity."""
    return sq_norms_of([c])[0]


def _dense_sq_norms(gs: list[torch.Tensor]) -> torch.Tensor:
    """Per-example squared norms [K, B] of K per-example gradients [B, ...] of equal numel: one stacked product."""
    g = _flat_stacked(gs)
    return torch.linalg.vecdot(g, g)


Pending = list[tuple["Outer | Combination", torch.Tensor, torch.Tensor]]
# ghost norms that may have cancelled: (capture, its squared norms [B], the mask [B] of the examples to recompute)


def sq_norms_of(captures: list[Capture], pending: Pending | None = None) -> list[torch.Tensor]:
    """``sq_norms`` of each capture, batched: the ghost-normed ``Outer`` captures of equal steps together
    (``_ghost_sq_norms``), the dense ones of equal size together (``_dense_sq_norms``), each in runs whose
    temporaries fit in ``chunk_elements``. The ghost norms whose steps could cancel come with the mask of the
    examples to recompute from their materialised gradients (rare for one capture; common for a ``Combination``
    whose coefficients cancel): appended to ``pending`` if given (the caller ``resolve``s them after reading
    ``cancelled(pending)`` with whatever else it reads), else resolved here, with one host synchronisation for all
    of them (none if no capture has steps to cancel)."""
    out: list[torch.Tensor | None] = [None] * len(captures)
    own = pending is None
    pending = [] if pending is None else pending
    ghost: dict[Hashable, list[int]] = {}
    dense: dict[Hashable, list[int]] = {}
    grads: dict[int, torch.Tensor] = {}
    for i, c in enumerate(captures):
        if isinstance(c, Combination):
            c.check_unchanged()
            out[i], cancelled = _combination_sq_norms(c)
            pending.append((c, out[i], cancelled))
        elif isinstance(c, Outer):
            c.check_unchanged()
            if by_materializing(c):
                out[i] = _materialized_sq_norms(c)
            else:
                key = (c.steps, c.factor_temporaries(), _wide(c.right.dtype), c.device, c.batch_size)
                ghost.setdefault(key, []).append(i)
        else:
            grads[i] = g = c.materialize()
            dense.setdefault((math.prod(c.shape), _wide(g.dtype), g.device, c.batch_size), []).append(i)
    for (steps, temporaries, _, device, batch), items in ghost.items():
        for run in _runs(items, batch * (temporaries + 3 * steps * steps), device):
            sq, cancelled = _ghost_sq_norms([captures[i] for i in run])
            for k, i in enumerate(run):
                out[i] = sq[k]
                if cancelled is not None:
                    pending.append((captures[i], sq[k], cancelled[k]))
    for (numel, _, device, batch), items in dense.items():
        for run in _runs(items, batch * numel, device):
            for i, sq in zip(run, _dense_sq_norms([grads[i] for i in run])):
                out[i] = sq
    if own:
        resolve(pending)
    return out


def cancelled(pending: Pending) -> torch.Tensor:
    """[n]: the number of examples to recompute over all of ``pending``, on the device (float64)."""
    return torch.stack([m for _, _, m in pending]).sum(dtype=torch.float64).reshape(1)


def resolve(pending: Pending) -> None:
    """The examples of ``pending`` whose ghost norms cancelled recomputed in place from their materialised
    gradients: one host synchronisation (which examples, for every capture at once) unless ``pending`` is empty."""
    if not pending:
        return
    masks = torch.stack([m for _, _, m in pending]).tolist()
    for (c, sq, _), mask in zip(pending, masks):
        if any(mask):  # a scan at C speed: the list of rows is formed for the few captures that cancelled
            rows = [i for i, cancelled in enumerate(mask) if cancelled]
            _recompute(c, sq, torch.tensor(rows, device=sq.device))


def outer_runs(captures: list[Outer]) -> list[list[int]]:
    """The positions of ``captures`` (dense-factored ``Outer``: Linear layers) in runs of captures with factors of
    equal shapes, dtypes and device whose stacked factors and sums fit in ``chunk_elements`` together (one capture a
    run where one alone does not), each run in the order of its first capture, for ``outer_sums``."""
    groups: dict[Hashable, list[int]] = {}
    for k, c in enumerate(captures):
        groups.setdefault((c.left.shape, c.left.dtype, c.right.shape, c.right.dtype, c.device), []).append(k)
    runs = []
    for (left, _, right, _, device), items in groups.items():
        (b, t, rows), cols = left, right[-1]
        runs += _runs(items, b * t * (rows + cols) + rows * cols, device)
    return sorted(runs)


def outer_sums(run: list[Outer], weights: list[torch.Tensor], sanitize: bool = True) -> list[torch.Tensor]:
    """``run[k].weighted_sum(weights[k])`` for every k, for a run of ``outer_runs``: its factors stacked (float32
    at least), the smaller one rescaled, non-finite entries zeroed (with ``sanitize``), and one batched product
    [K, rows, B*T] @ [K, B*T, cols] for all of them."""
    if len(run) == 1:
        return [run[0].weighted_sum(weights[0], sanitize)]
    for c in run:
        c.check_unchanged()
    first = run[0]
    b, t, rows = first.left.shape
    dtype = _wide(torch.promote_types(first.left.dtype, first.right.dtype))
    left = _stacked([c.left for c in run], dtype)
    right = _stacked([c.right for c in run], dtype)
    (left if rows <= first.cols else right).mul_(_stacked_weights(weights, dtype).view(len(run), b, 1, 1))
    left, right = _zeroed(left, True, sanitize), _zeroed(right, True, sanitize)
    total = torch.bmm(left.view(-1, b * t, rows).transpose(1, 2), right.view(-1, b * t, first.cols))
    return [s.view(c.shape) for c, s in zip(run, total)]


def coalesce(terms: list[tuple[float, Outer]]) -> Outer:
    """sum_k c_k G_k for one-hot captures of one parameter (an embedding table used at two points, or twice)
    as one capture whose rows are distinct within each example: its ghost norm then has no cross terms
    between equal rows, so nothing cancels, and its weighted sum adds the same merged rows. Its T steps (the
    terms' together) hold an example's merged rows first, in ascending order, then (row 0, zero vector) padding;
    float32 at least. Static shapes, no host synchronisation: each example's rows are sorted, a step starts a new
    merged row where its row differs from the one before, and the vectors are added into their merged rows."""
    index = _cat([t.left for _, t in terms], 1)
    right = _cat([_f32(t.right) if c == 1.0 else _f32(t.right) * c for c, t in terms], 1)
    ordered, order = index.sort(1)
    merged = F.pad((ordered[:, 1:] != ordered[:, :-1]).cumsum(1), (1, 0))  # slot of the i-th smallest row
    slot = torch.empty_like(merged).scatter_(1, order, merged)  # slot of each step
    left = index.new_zeros(index.shape).scatter_(1, slot, index)
    vectors = right.new_zeros(right.shape).scatter_add_(1, slot.unsqueeze(-1).expand(right.shape), right)
    return Outer(left, vectors, terms[0][1].rows, terms[0][1].shape)


def difference(terms: list[tuple[float, Outer]]) -> Outer | None:
    """c_a A + c_b B for two dense-factored ``Outer`` captures of one parameter with factors of equal shapes and
    coefficients of opposite signs (a two-point difference: SRG's g_t - c g_{t-1}, Accelerated-DP-SRGD's
    eta g(x_t) - (eta - 1) g(x_{t-1}), DiSK's c g(x') + (1 - c) g(x) at c > 1) as one capture whose steps are
    small where the two points are close:
        c_a A + c_b B = (c_a + c_b) A + c_b (B - A),   B - A = sum_t (l_bt - l_at) (x) r_bt + l_at (x) (r_bt - r_at).
    Exact in real arithmetic; in float32 its ghost norm's rounding error is u times these 3T steps' own norms
    rather than the two points' (eta times larger), so the cancellation guard of ``_ghost_sq_norms`` rarely
    fires, and the sum by book-keeping is as accurate. None where it does not apply, or where the result would be
    normed from materialised gradients (``by_materializing``: decided from the shapes, before anything is formed)."""
    if len(terms) != 2:
        return None
    (ca, a), (cb, b) = terms
    if not (ca * cb < 0 and type(a) is Outer and type(b) is Outer and not a.indexed and not b.indexed
            and a.left.shape == b.left.shape and a.right.shape == b.right.shape):
        return None
    steps = 3 * a.steps  # the result's: by_materializing(result), from its shapes
    if gram_cost(steps, steps, a.rows, a.cols) > materializing_cost(steps, steps, a.rows, a.cols):
        return None
    a.check_unchanged()
    b.check_unchanged()
    la, ra, lb, rb = _f32(a.left), _f32(a.right), _f32(b.left), _f32(b.right)
    left = torch.cat([(ca + cb) * la, cb * (lb - la), cb * la], 1)
    return Outer(left, torch.cat([ra, rb, rb - ra], 1), a.rows, a.shape)
