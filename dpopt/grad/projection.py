"""Projections of per-example gradients (DP-GRAPE, Algorithm 1, lines 3-9), applied inside backprop.

A projected weight W (out x in) keeps its larger side: with P of shape (min(out, in) x r),
R_i = P^T G_i (r x in) when out < in ("left"), R_i = G_i P (out x r) otherwise ("right"). Since
G_i = sum_t g_t (x) a_t, this is the capture with its output-gradient factor (left) or activation factor
(right) multiplied by P: the engine projects each Linear capture the moment it is made, so neither the
full per-example gradient nor the unprojected factor is kept. The clipped sum of projected per-example
gradients is then one contraction of the projected factors, P^T applied to the book-keeping sum: no
per-example tensor of any kind is kept (the combination the paper lists as future work).

``RandomProjection``: P has iid N(0, 1/r) entries from a *public* generator seeded by (seed, parameter
name, subspace index), regenerated whenever needed (never stored; one P alive at a time) and refreshed
every ``every`` steps (subspace k = t // every, so the schedule is defined from step 0). E[P P^T] = I.
``SVDProjection``: naive DP-GaLore (Algorithm 5): P from the SVD of the *privatized* gradient every
``every`` steps (post-processing), stored per layer; the statistic is the full gradient.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dpopt.grad.captures import Capture, Dense, Outer
from dpopt.grad.engine import PerExampleEngine
from dpopt.grad.rules import RULES
from dpopt.noise.rng import public_generator
from dpopt.transforms.base import Transform

EXCLUDE = ("head", "classifier", "lm_head")


def projectable(engine: PerExampleEngine, rank: int, exclude: tuple[str, ...] = EXCLUDE) -> dict[int, str]:
    """Parameter index -> side for every Linear weight worth projecting: used by one layer only (not tied
    to an embedding), not a head, and with min(out, in) > rank."""
    uses: dict[int, int] = {}
    for unit in engine.units:
        for i in unit.params.values():
            uses[i] = uses.get(i, 0) + 1
    sides = {}
    for unit in engine.units:
        if unit.rule is not RULES[torch.nn.Linear] or "weight" not in unit.params:
            continue
        i = unit.params["weight"]
        out_f, in_f = engine.params[i].shape
        if uses[i] == 1 and min(out_f, in_f) > rank and not any(x in unit.name.split(".") for x in exclude):
            sides[i] = "left" if out_f < in_f else "right"
    return sides


class Projection(Transform):
    """Which weights are projected, on which side, and their current P. A transform only to count steps."""

    def __init__(self, engine: PerExampleEngine, rank: int, every: int, exclude: tuple[str, ...] = EXCLUDE) -> None:
        if rank < 1:
            raise ValueError(f"the projection rank must be >= 1, got {rank}")
        if every < 1:
            raise ValueError(f"the subspace must be refreshed every >= 1 steps, got {every}")
        self.engine, self.rank, self.every = engine, rank, every
        self.sides = projectable(engine, rank, exclude)
        if not self.sides:
            raise ValueError(f"no Linear weight has both sides larger than rank {rank}: nothing to project")
        self.step = 0

    def shape(self, i: int) -> torch.Size:
        out_f, in_f = self.engine.params[i].shape
        return torch.Size((self.rank, in_f) if self.sides[i] == "left" else (out_f, self.rank))

    def matrix(self, i: int) -> torch.Tensor:
        raise NotImplementedError

    def project_gradient(self, i: int, g: torch.Tensor) -> torch.Tensor:
        """P^T G (left) or G P (right) for a full gradient G."""
        p = self.matrix(i).to(g.dtype)
        return p.T @ g if self.sides[i] == "left" else g @ p

    def lift(self, i: int, u: torch.Tensor) -> torch.Tensor:
        """Back to the weight's space: P U (left) or U P^T (right)."""
        p = self.matrix(i).to(u.dtype)
        return p @ u if self.sides[i] == "left" else u @ p.T

    def after_update(self, params: list[torch.Tensor]) -> None:
        self.step += 1

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


class RandomProjection(Projection):
    """DP-GRAPE's public Gaussian projections, applied to the statistic by the engine."""

    def __init__(self, engine: PerExampleEngine, rank: int, every: int, seed: int,
                 exclude: tuple[str, ...] = EXCLUDE) -> None:
        super().__init__(engine, rank, every, exclude)
        self.seed = seed

    def matrix(self, i: int) -> torch.Tensor:
        """Regenerated bit-identically from (seed, name, subspace): float32 on the CPU, then moved."""
        p = self.engine.params[i]
        rows = min(p.shape)
        g = public_generator(self.seed, "grape", self.engine.names[i], self.step // self.every)
        return (torch.randn(rows, self.rank, generator=g) / math.sqrt(self.rank)).to(p.device)

    def project(self, i: int, capture: Capture) -> Capture:
        """The capture of R_i = P^T G_i or G_i P: the matching factor times P."""
        p = self.matrix(i)
        left = self.sides[i] == "left"
        shape = self.shape(i)
        if isinstance(capture, Outer) and not capture.indexed:
            if left:
                return Outer(capture.left @ p.to(capture.left.dtype), capture.right, self.rank, shape)
            return Outer(capture.left, capture.right @ p.to(capture.right.dtype), capture.rows, shape)
        g = capture.materialize().reshape(capture.batch_size, *self.engine.params[i].shape)
        p = p.to(g.dtype)
        return Dense(torch.einsum("bmn,mr->brn", g, p) if left else g @ p, shape)


class SVDProjection(Projection):
    """Naive DP-GaLore: every ``every`` steps P = the top-r singular vectors of the privatized gradient
    (on the projected side); free post-processing of the release, stored per layer."""

    def __init__(self, engine: PerExampleEngine, rank: int, every: int, exclude: tuple[str, ...] = EXCLUDE) -> None:
        super().__init__(engine, rank, every, exclude)
        self.matrices: dict[int, torch.Tensor] = {}

    def matrix(self, i: int) -> torch.Tensor:
        return self.matrices[i]

    def __call__(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.step % self.every == 0:
            for i, side in self.sides.items():
                u, _, vh = torch.linalg.svd(grads[i].float(), full_matrices=False)
                self.matrices[i] = (u[:, :self.rank] if side == "left" else vh[:self.rank].T).contiguous()
        return grads

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "matrices": self.matrices}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.matrices = state["step"], state["matrices"]
