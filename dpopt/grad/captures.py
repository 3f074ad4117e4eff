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

# Temporaries of per-example work are processed in chunks of examples holding at most this many elements.
CHUNK_ELEMENTS = 1 << 24


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

    def materialize(self) -> torch.Tensor:
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

    def materialize(self) -> torch.Tensor:
        return self.g

    def weighted_sum(self, w: torch.Tensor) -> torch.Tensor:
        return torch.tensordot(w.to(self.g.dtype), self.g, dims=1)

    def held_elements(self) -> int:
        return self.g.numel()


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

    def materialize(self) -> torch.Tensor:
        self.check_unchanged()
        b, t, n = self.right.shape
        if self.indexed:
            out = self.right.new_zeros(b, self.rows, n)
            out.scatter_add_(1, self.left.unsqueeze(-1).expand(b, t, n), self.right)
        else:
            out = torch.bmm(self.left.transpose(1, 2), self.right)
        return out.view(b, *self.shape)

    def weighted_sum(self, w: torch.Tensor) -> torch.Tensor:
        self.check_unchanged()
        b, t, n = self.right.shape
        if self.indexed:
            scaled = (self.right * w.to(self.right.dtype).view(b, 1, 1)).reshape(b * t, n)
            out = self.right.new_zeros(self.rows, n).index_add_(0, self.left.reshape(-1), scaled)
        else:
            left = (self.left * w.to(self.left.dtype).view(b, 1, 1)).reshape(b * t, self.rows)
            out = left.T @ self.right.reshape(b * t, n)
        return out.view(self.shape)

    def held_elements(self) -> int:
        return self.left.numel() + self.right.numel()

    def materialized_elements(self) -> int:
        return self.batch_size * self.rows * self.cols

    def ghost_cost(self, other: "Outer") -> int:
        """Multiply-adds of the Gram route for <self, other> per example."""
        left = 0 if self.indexed or other.indexed else self.rows
        return self.steps * other.steps * (left + self.cols)

    def materialize_cost(self, other: "Outer") -> int:
        return (self.steps + other.steps + 1) * self.rows * self.cols


def _left_gram(a: Outer, b: Outer, s: slice) -> torch.Tensor:
    """(L_a L_b^T)[i] for the examples in ``s``: [n, T_a, T_b]."""
    la, lb = a.left[s], b.left[s]
    if a.indexed and b.indexed:
        return (la.unsqueeze(2) == lb.unsqueeze(1)).to(_f32(a.right).dtype)
    if a.indexed:  # one-hot rows of a pick entries of b's dense left factors
        n, tb, _ = lb.shape
        return torch.gather(_f32(lb), 2, la.unsqueeze(1).expand(n, tb, la.shape[1])).transpose(1, 2)
    if b.indexed:
        return _left_gram(b, a, s).transpose(1, 2)
    return torch.bmm(_f32(la), _f32(lb).transpose(1, 2))


def _inner_outer(a: Outer, b: Outer) -> torch.Tensor:
    cheap_ghost = a.indexed or b.indexed or a.ghost_cost(b) <= a.materialize_cost(b)
    if not cheap_ghost:
        return _inner_dense(a.materialize(), b.materialize())
    out = []
    for s in _chunks(a.batch_size, a.steps * b.steps * 2):
        right = torch.bmm(_f32(a.right[s]), _f32(b.right[s]).transpose(1, 2))
        out.append((_left_gram(a, b, s) * right).sum((1, 2)))
    return torch.cat(out)


def _inner_outer_dense(a: Outer, d: torch.Tensor) -> torch.Tensor:
    """sum_t left_t^T D_i right_t per example, for a dense per-example gradient D."""
    d = d.reshape(a.batch_size, a.rows, a.cols)
    out = []
    for s in _chunks(a.batch_size, a.steps * max(a.rows, a.cols)):
        ds, right = _f32(d[s]), _f32(a.right[s])
        if a.indexed:
            left = a.left[s]
            picked = torch.gather(ds, 1, left.unsqueeze(-1).expand(*left.shape, a.cols))
            out.append((picked * right).sum((1, 2)))
        else:
            out.append((torch.bmm(_f32(a.left[s]), ds) * right).sum((1, 2)))
    return torch.cat(out)


def _inner_dense(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    n = a.shape[0]
    return (_f32(a).reshape(n, -1) * _f32(b).reshape(n, -1)).sum(1)


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
