"""Per-example gradients of one parameter, held in the cheapest form, and the algebra on them.

A ``Capture`` is what one use of one parameter in one forward/backward contributed to every example's
gradient. Two forms:

* ``Dense`` — the per-example gradients themselves, ``g[i]`` of the parameter's shape.
* ``Outer`` — a sum of outer products per example, G_i = sum_t left[i, t] (x) right[i, t], which is how
  Linear, Conv (unfolded) and Embedding gradients arise. ``left`` may be an index tensor (the rows an
  Embedding looked up), meaning one-hot vectors. Never materialised unless that is cheaper.

Only three operations are needed by every clipping rule and every algorithm: ``inner(a, b)`` (per-example
inner products, so norms of linear combinations such as c*G(x+gd) + (1-c)*G(x) need no materialisation;
for two ``Outer`` captures this is the ghost-norm identity <L_a R_a^T, L_b R_b^T> = sum_ts (L_a L_b^T)_ts
(R_a R_b^T)_ts), ``weighted_sum(w)`` (sum_i w_i G_i in one contraction: the book-keeping trick) and
``materialize()``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# Per-example temporaries (Gram matrices, unfolded patches) are formed for chunks of examples holding at
# most this many elements, so the clip stage never needs more than a few MB on top of the captures.
CHUNK_ELEMENTS = 1 << 20


def _chunks(batch: int, per_example: int) -> list[slice]:
    size = max(1, CHUNK_ELEMENTS // max(1, per_example))
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


class Capture:
    """Per-example gradients of one parameter (``shape``) for ``batch_size`` examples."""

    batch_size: int
    shape: torch.Size

    def materialize(self, s: slice = slice(None)) -> torch.Tensor:
        """The per-example gradients of the examples in ``s``, [n, *shape]."""
        raise NotImplementedError

    def weighted_sum(self, w: torch.Tensor) -> torch.Tensor:
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

    def weighted_sum(self, w: torch.Tensor) -> torch.Tensor:
        return torch.tensordot(w.to(self.g.dtype), self.g, dims=1)

    def held_elements(self) -> int:
        return self.g.numel()

    def subset(self, rows: torch.Tensor) -> "Dense":
        return Dense(self.g[rows], self.shape)


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
        self.check_unchanged()
        left, right = self.left[s], self.right[s]
        b, t, n = right.shape
        if self.indexed:
            out = right.new_zeros(b, self.rows, n)
            out.scatter_add_(1, left.unsqueeze(-1).expand(b, t, n), right)
        else:
            out = torch.bmm(left.transpose(1, 2), right)
        return out.view(b, *self.shape)

    def weighted_sum(self, w: torch.Tensor) -> torch.Tensor:
        self.check_unchanged()
        b, t, n = self.right.shape
        if self.indexed:
            scaled = (self.right * w.to(self.right.dtype).view(b, 1, 1)).reshape(b * t, n)
            out = self.right.new_zeros(self.rows, n).index_add_(0, self.left.reshape(-1), scaled)
        elif self.left.shape[-1] <= n:  # rescale the smaller factor
            left = (self.left * w.to(self.left.dtype).view(b, 1, 1)).reshape(b * t, self.rows)
            out = left.T @ self.right.reshape(b * t, n)
        else:
            right = (self.right * w.to(self.right.dtype).view(b, 1, 1)).reshape(b * t, n)
            out = self.left.reshape(b * t, self.rows).T @ right
        return out.view(self.shape)

    def held_elements(self) -> int:
        return self.left.numel() + self.right.numel()

    def materialized_elements(self) -> int:
        return self.batch_size * self.rows * self.cols

    def ghost_cost(self, other: "Outer") -> float:
        """Multiply-adds of the Gram route for <self, other> per example."""
        left = 0 if self.indexed or other.indexed else self.rows
        return self.steps * other.steps * (left + self.cols)

    def materialize_cost(self, other: "Outer") -> int:
        return (self.steps + other.steps + 1) * self.rows * self.cols


class ConvOuter(Outer):
    """A Conv2d weight's per-example gradients kept as the layer's input and output gradient.

    Its factors are the unfolded input patches (k*k times larger than the input) and the output gradient;
    they are formed only per chunk of examples, for ghost norms. The weighted sum is the convolution
    weight-gradient kernel on the rescaled output gradient, and materialising is one grouped convolution
    with the batch folded into the groups (Rochette et al., 2019), so no unfold is kept.
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

    def check_unchanged(self) -> None:
        check_version(self.x, self._versions[0])
        check_version(self.g, self._versions[1])

    @property
    def indexed(self) -> bool:
        return False

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

    def _weight_grad(self, x: torch.Tensor, g: torch.Tensor, shape: tuple[int, ...], groups: int) -> torch.Tensor:
        return torch.nn.grad.conv2d_weight(x, shape, g, stride=self.stride, padding=self.padding,
                                           dilation=self.dilation, groups=groups)

    def ghost_cost(self, other: "Outer") -> float:
        """The Gram route needs the unfolded input, and unfolding costs more than the grouped convolution
        that materialises the gradients (8x for the Tanh CNN's second layer, measured on CPU): never taken."""
        return math.inf

    def materialize(self, s: slice = slice(None)) -> torch.Tensor:
        self.check_unchanged()
        x, g = self.x[s], self.g[s]
        b, c_in, h, w = x.shape
        c_out = g.shape[1]
        per_group_in = c_in // self.groups
        grads = self._weight_grad(x.reshape(1, b * c_in, h, w), g.reshape(1, b * c_out, *g.shape[2:]),
                                  (b * c_out, per_group_in, *self.kernel), b * self.groups)
        return grads.view(b, *self.shape)

    def weighted_sum(self, w: torch.Tensor) -> torch.Tensor:
        self.check_unchanged()
        g = self.g * w.to(self.g.dtype).view(-1, 1, 1, 1)
        shape = (self.rows, self.x.shape[1] // self.groups, *self.kernel)
        return self._weight_grad(self.x, g, shape, self.groups).view(self.shape)

    def held_elements(self) -> int:
        return self.x.numel() + self.g.numel()


def _left_gram(la: torch.Tensor, lb: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """L_a L_b^T per example, [n, T_a, T_b]; an int64 factor holds the indices of one-hot rows."""
    a_idx, b_idx = not la.is_floating_point(), not lb.is_floating_point()
    if a_idx and b_idx:
        return (la.unsqueeze(2) == lb.unsqueeze(1)).to(dtype)
    if a_idx:  # one-hot rows of a pick entries of b's dense left factors
        n, tb, _ = lb.shape
        return torch.gather(_f32(lb), 2, la.unsqueeze(1).expand(n, tb, la.shape[1])).transpose(1, 2)
    if b_idx:
        return _left_gram(lb, la, dtype).transpose(1, 2)
    return torch.bmm(_f32(la), _f32(lb).transpose(1, 2))


def _inner_outer(a: Outer, b: Outer) -> torch.Tensor:
    """By the ghost identity where it is cheaper, else from per-example gradients materialised a chunk of
    examples at a time; a norm (``a is b``) forms each chunk's factors or gradients once."""
    out = []
    if a.indexed or b.indexed or a.ghost_cost(b) <= a.materialize_cost(b):
        for s in _chunks(a.batch_size, a.factor_temporaries() + b.factor_temporaries() + 3 * a.steps * b.steps):
            la, ra = a.factors(s)
            lb, rb = (la, ra) if b is a else b.factors(s)
            right = torch.bmm(_f32(ra), _f32(rb).transpose(1, 2))
            out.append(_pairwise_dot(_left_gram(la, lb, right.dtype), right))
    else:
        for s in _chunks(a.batch_size, 2 * a.rows * a.cols):
            ga = a.materialize(s)
            out.append(_inner_dense(ga, ga if b is a else b.materialize(s)))
    return torch.cat(out)


def _inner_outer_dense(a: Outer, d: torch.Tensor) -> torch.Tensor:
    """sum_t left_t^T D_i right_t per example, for a dense per-example gradient D."""
    d = d.reshape(a.batch_size, a.rows, a.cols)
    out = []
    for s in _chunks(a.batch_size, a.factor_temporaries() + 2 * a.steps * max(a.rows, a.cols)):
        left, right = a.factors(s)
        ds, right = _f32(d[s]), _f32(right)
        if a.indexed:
            picked = torch.gather(ds, 1, left.unsqueeze(-1).expand(*left.shape, a.cols))
            out.append((picked * right).sum((1, 2)))
        else:
            out.append((torch.bmm(_f32(left), ds) * right).sum((1, 2)))
    return torch.cat(out)


def _pairwise_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum over all but the first dimension of a * b (operands are chunk-sized: a product temporary is fine,
    and 4x faster on CPU than a batched matrix product)."""
    n = a.shape[0]
    return torch.linalg.vecdot(a.reshape(n, -1), b.reshape(n, -1))


def _inner_dense(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _pairwise_dot(_f32(a), _f32(b))


def inner(a: Capture, b: Capture) -> torch.Tensor:
    """Per-example inner products <G_a[i], G_b[i]> (float32, shape [B])."""
    if a.batch_size != b.batch_size or a.shape.numel() != b.shape.numel():
        raise ValueError("captures of different batches or parameters cannot be combined")
    for c in (a, b):
        if isinstance(c, Outer):
            c.check_unchanged()
    if isinstance(a, Outer) and isinstance(b, Outer):
        return _inner_outer(a, b)
    if isinstance(a, Outer):
        return _inner_outer_dense(a, b.materialize())
    if isinstance(b, Outer):
        return _inner_outer_dense(b, a.materialize())
    return _inner_dense(a.materialize(), b.materialize())
