"""Stage 2 for zeroth-order methods: per-example finite differences along a public random direction.

DPZero (Zhang et al. 2024, Alg. 2) and DPGD-0th (Alg. 1) estimate the gradient from two forward passes per
step: s_i = (f(x + λu; ξ_i) − f(x − λu; ξ_i)) / 2λ (Eq. 2), one scalar per example, along a direction u that
does not depend on the data. Nothing here builds a backward graph.

* ``Direction`` — u_t, drawn N(0, I) (the paper's experiments, L547) or uniformly on the sphere of radius
  √d over all parameters jointly (the theory, L77), from a *public* generator seeded by (seed, step,
  parameter index). It is never stored: every use regenerates it, one parameter tensor at a time and in
  chunks of at most ``chunk`` elements, so its memory cost is one chunk, not one model.
* ``finite_differences`` — perturbs the parameters in place (+λu, −2λu, +λu back), evaluates the
  per-example losses twice, in eval mode and under the same RNG state, and returns ``PerExampleScalars``.
* ``PerExampleScalars`` — the statistic DPZero privatizes. Seen by the clip stage as a one-element vector
  per example, flat clipping to C *is* clamp(s_i, −C, C) (L57, L187), and the noise stage adds one scalar.
* ``DirectionalGradients`` — DPGD-0th's per-example vectors s_i·u, never materialised: their norms are
  |s_i|·‖u‖ and their weighted sum is (Σ_i w_i s_i)·u, regenerated.

Precision (spec pitfall 7): u is drawn in float32 (float64 for float64 parameters) and added in that
precision, so a +λ, −2λ, +λ cycle returns each parameter to within a few rounding units of its value; half
precision parameters are perturbed through float32 but still stored rounded (measure the drift before
using λ = 1e-3 with bf16 weights).
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Sequence

import torch

from dpopt.clipping import PerExampleStatistic
from dpopt.device import rng_state, set_rng_state
from dpopt.grad.batch import batch_size_of
from dpopt.grad.engine import PerExampleEngine
from dpopt.noise.rng import public_generator
from dpopt.transforms.base import Transform

DIRECTION_LAWS = ("gaussian", "sphere")
CHUNK = 1 << 20  # elements of u alive at once (4 MB in float32)


def _draw_dtype(p: torch.Tensor) -> torch.dtype:
    return p.dtype if p.dtype in (torch.float32, torch.float64) else torch.float32


class Direction(Transform):
    """The public direction u_t of step t, regenerated on demand (never stored).

    A transform only to count steps (``after_update``), so that the statistic and the update of one step
    see the same u_t and a checkpoint resumes the sequence. u_t is a function of (seed, t) alone: publishing
    the seed reveals nothing about the data (L897: "the randomness of u_t is never used for the privacy
    guarantee"), and the privacy noise never comes from it.
    """

    def __init__(self, params: Sequence[torch.Tensor], seed: int, law: str = "gaussian", chunk: int = CHUNK) -> None:
        if law not in DIRECTION_LAWS:
            raise ValueError(f"unknown direction law {law!r}; choose one of {', '.join(DIRECTION_LAWS)}")
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.params, self.seed, self.law, self.chunk = list(params), int(seed), law, chunk
        self.dimension = sum(p.numel() for p in self.params)
        self.step = 0
        self._scale: tuple[int, float] | None = None

    # --- the draws -------------------------------------------------------------------------------
    def _raw(self, step: int) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(parameter index, flat offset, chunk of z ~ N(0, I)) in a fixed order. The chunk is a view of a
        reused buffer: use it before asking for the next one."""
        buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        for i, p in enumerate(self.params):
            g = public_generator(self.seed, "zeroth-order direction", step, i, device=p.device)
            key = (p.device, _draw_dtype(p))
            if key not in buffers:
                size = min(self.chunk, max(q.numel() for q in self.params))
                buffers[key] = torch.empty(size, device=p.device, dtype=key[1])
            for start in range(0, p.numel(), self.chunk):
                yield i, start, buffers[key][:min(self.chunk, p.numel() - start)].normal_(generator=g)

    def scale(self, step: int) -> float:
        """1 for the Gaussian law; √d / ‖z‖ for the sphere (one extra pass over z, cached per step)."""
        if self.law == "gaussian":
            return 1.0
        if self._scale is None or self._scale[0] != step:
            total = sum(float(z.double().square().sum()) for _, _, z in self._raw(step))
            self._scale = (step, math.sqrt(self.dimension / total))
        return self._scale[1]

    def pieces(self, step: int) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(parameter index, flat offset, chunk of u_t), u_t with its law's scale applied."""
        scale = self.scale(step)
        for i, start, z in self._raw(step):
            yield i, start, z if scale == 1.0 else z.mul_(scale)

    # --- what the algorithms do with it ------------------------------------------------------------
    @torch.no_grad()
    def add_to_params(self, alpha: float, step: int) -> None:
        """x ← x + alpha·u_t, in place, one chunk at a time. u_t's coordinates are in the parameters' logical
        (row-major) order, whatever their memory layout: a channels-last parameter is updated through a
        row-major copy."""
        flats = [p.detach().contiguous().view(-1) for p in self.params]  # the parameter itself when row-major
        for i, start, u in self.pieces(step):
            x = flats[i][start:start + u.numel()]
            if x.dtype == u.dtype:
                x.add_(u, alpha=alpha)
            else:  # half precision: add in float32, round once
                x.copy_(x.to(u.dtype).add_(u, alpha=alpha))
        for p, flat in zip(self.params, flats):
            if not p.is_contiguous():
                p.copy_(flat.view(p.shape))

    def combine(self, coefficients: Sequence[float], step: int) -> list[torch.Tensor]:
        """[c_p·u_{t,p}] per parameter p, as new tensors (DPGD-0th's clipped sum)."""
        out = [torch.zeros(p.shape, device=p.device, dtype=_draw_dtype(p)) for p in self.params]
        flats = [o.view(-1) for o in out]
        for i, start, u in self.pieces(step):
            flats[i][start:start + u.numel()].add_(u, alpha=float(coefficients[i]))
        return out

    def sq_norms(self, step: int) -> torch.Tensor:
        """‖u_{t,p}‖² per parameter, float64 [P]."""
        acc = torch.zeros(len(self.params), dtype=torch.float64)
        for i, _, u in self.pieces(step):
            acc[i] += float(u.double().square().sum())
        return acc

    def materialize(self, step: int) -> list[torch.Tensor]:
        """u_t as full tensors (tests and small models only)."""
        return self.combine([1.0] * len(self.params), step)

    # --- Transform: count steps, save the position -------------------------------------------------
    def after_update(self, params: list[torch.Tensor]) -> None:
        self.step += 1

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


class PerExampleScalars(PerExampleStatistic):
    """One scalar per example, in the form the clip stage takes: a one-element vector whose norm is |s_i|,
    so flat clipping to C is clamp(s_i, −C, C) and the noise stage adds one scalar N(0, σ²C²)."""

    groups = [0]
    shapes = [torch.Size([])]

    def __init__(self, values: torch.Tensor, losses: torch.Tensor | None = None) -> None:
        self.values, self.losses = values, losses
        self.batch_size = values.shape[0]

    def sq_norms(self) -> torch.Tensor:
        return self.values.square().unsqueeze(1)

    def weighted_sum(self, weights: torch.Tensor, release: bool = False) -> list[torch.Tensor]:
        """[Σ_i w_i s_i] as a 0-dim tensor; examples of weight 0 (non-finite s_i) contribute exactly zero.
        (Nothing to ``release``: B scalars.)"""
        w = weights.reshape(self.batch_size).to(self.values.dtype)
        return [torch.where(w != 0, w * self.values, torch.zeros_like(w)).sum()]

    def materialize(self) -> list[torch.Tensor]:
        return [self.values]


class DirectionalGradients(PerExampleStatistic):
    """DPGD-0th's per-example vectors g_i = s_i·u_t (Alg. 1 line 5), never materialised: ‖g_i‖ restricted to
    parameter p is |s_i|·‖u_p‖, and Σ_i w_ip g_i is (Σ_i w_ip s_i)·u_p, regenerated from the seed."""

    def __init__(self, scalars: PerExampleScalars, direction: Direction, groups: list[int], step: int) -> None:
        self.scalars, self.direction, self.groups, self.step = scalars, direction, groups, step
        self.batch_size, self.losses = scalars.batch_size, scalars.losses

    def sq_norms(self) -> torch.Tensor:
        return self.scalars.values.square().unsqueeze(1) * self.direction.sq_norms(self.step).unsqueeze(0)

    def weighted_sum(self, weights: torch.Tensor, release: bool = False) -> list[torch.Tensor]:
        """(Σ_i w_ip s_i)·u_p per parameter (nothing to ``release``: u is regenerated, never held)."""
        if weights.dim() == 1:
            weights = weights.unsqueeze(1).expand(-1, len(self.direction.params))
        s = self.scalars.values.unsqueeze(1)
        w = weights.to(s.dtype)
        coefficients = torch.where(w != 0, w * s, torch.zeros_like(w)).sum(0)
        return self.direction.combine(coefficients.tolist(), self.step)


@torch.no_grad()
def finite_differences(engine: PerExampleEngine, batch: Any, direction: Direction, smoothing: float,
                       step: int | None = None) -> PerExampleScalars:
    """s_i = (f(x + λu; ξ_i) − f(x − λu; ξ_i)) / 2λ for every example of ``batch`` (Eq. 2, Alg. 2 line 5).

    The parameters are moved in place to x + λu, then x − λu, then back (restored even if the loss raises).
    Both passes run in eval mode (no dropout) under the same RNG state, so they see the same function
    (spec pitfall 4), autocast to the engine's precision. The difference is taken in float64. ``losses`` is
    (f(x+λu) + f(x−λu)) / 2 ≈ f(x), for progress display only.
    """
    if not (math.isfinite(smoothing) and smoothing > 0):
        raise ValueError(f"the smoothing lambda must be a finite number > 0, got {smoothing}")
    step = direction.step if step is None else step
    b = batch_size_of(batch)
    model = engine.model
    was_training = model.training
    model.eval()
    rng = rng_state(engine.params[0].device)
    offset = 0.0
    try:
        direction.add_to_params(smoothing, step)
        offset = smoothing
        with engine.autocast():
            plus = engine._check_losses(engine.loss(batch), b).double()
        direction.add_to_params(-2.0 * smoothing, step)
        offset = -smoothing
        set_rng_state(rng, engine.params[0].device)
        with engine.autocast():
            minus = engine._check_losses(engine.loss(batch), b).double()
    finally:
        if offset:
            direction.add_to_params(-offset, step)
        model.train(was_training)
    return PerExampleScalars((plus - minus) / (2.0 * smoothing), (plus + minus) / 2.0)
