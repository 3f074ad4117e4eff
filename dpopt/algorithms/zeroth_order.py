"""Zeroth-order recipes: DPZero, DPGD-0th and non-private MeZO (Zhang et al. 2024, "DPZero"; Malladi et al.
2023, "MeZO"). Each step is two forward passes along a public direction u_t; no backward graph is built.

* ``dpzero`` (Alg. 2, L182-188): the per-example scalar s_i is clipped to [−C, C], summed, one scalar of
  secret Gaussian noise is added, the result divided by the batch normaliser, and x ← x − α·g·u_t with u_t
  regenerated. The privacy event is exactly DP-SGD's with the same sampler and noise multiplier: a
  (subsampled) Gaussian on a sum of per-example statistics of norm ≤ C.
* ``dpgd-0th`` (Alg. 1, L121-128): the per-example vectors s_i·u_t are clipped to norm C and d-dimensional
  noise is added; the base update is plain SGD.
* ``mezo``: the plain mean of the s_i, no clipping, no noise. It is registered as non-private: the trainer
  refuses a privacy target for it and its ledger records releases with noise multiplier 0 (epsilon = inf).
"""

from __future__ import annotations

from typing import Any

import torch

from dpopt.algorithms.base import PrivateStep, Privatizer
from dpopt.algorithms.hyperparameters import ZerothOrder
from dpopt.algorithms.registry import register
from dpopt.clipping import ClipStats, PerExampleStatistic
from dpopt.data.buckets import Padding
from dpopt.grad.engine import PerExampleEngine
from dpopt.grad.zeroth_order import Direction, DirectionalGradients, PerExampleScalars, finite_differences
from dpopt.privacy.ledger import GaussianRelease

SCALAR = [torch.Size([])]


class DirectionalUpdate:
    """The base update x ← x − α·g·u_t (Alg. 2 line 7): the released scalar g times the public direction,
    regenerated chunk by chunk (no parameter-sized buffer)."""

    def __init__(self, direction: Direction, lr: float) -> None:
        self.direction, self.lr = direction, lr

    def apply(self, grads: list[torch.Tensor]) -> None:
        (g,) = grads
        self.direction.add_to_params(-self.lr * float(g), self.direction.step)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class NonPrivate(Privatizer):
    """The plain sum divided by the batch normaliser: no clipping, no noise (non-private baselines). Every
    step is recorded in the ledger as a Gaussian release with noise multiplier 0, so epsilon is inf; the
    clipping and noise it was built with are not used and the noise multiplier must be 0."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.noise.noise_multiplier != 0.0:
            raise ValueError("a non-private baseline adds no noise: build it with noise multiplier 0 "
                             f"(got {self.noise.noise_multiplier}), and do not give it a privacy target")

    def clip(self, grads: PerExampleStatistic, into: list[torch.Tensor] | None = None,
             padding: Padding | None = None) -> tuple[list[torch.Tensor], ClipStats]:
        """The plain sum of the examples of finite norm (no clipping); ``padding`` rows weigh 0 and count nowhere."""
        kept = torch.isfinite(grads.sq_norms().sum(1))
        examples = grads.batch_size
        if padding is not None:
            kept, examples = kept & padding.mask.bool(), padding.examples
        sums = grads.weighted_sum(kept.to(torch.float64))
        sums = sums if into is None else [a.add_(b) for a, b in zip(into, sums)]
        return sums, ClipStats(examples, examples - int(kept.sum()))

    def release(self, sums: list[torch.Tensor], step: int) -> list[torch.Tensor]:
        self.ledger.record(GaussianRelease(0.0, self.sampler.participation))
        for s in sums:
            s.div_(self.sampler.normalizer)
        return sums


def _direction(engine: PerExampleEngine, hp: ZerothOrder) -> Direction:
    return Direction(engine.params, hp.direction_seed, hp.direction)


def _scalar_step(engine: PerExampleEngine, privatizer: Privatizer, hp: ZerothOrder) -> PrivateStep:
    direction = _direction(engine, hp)

    def statistic(eng: PerExampleEngine, batch: Any) -> PerExampleScalars:
        return finite_differences(eng, batch, direction, hp.smoothing)

    return PrivateStep(engine, privatizer, DirectionalUpdate(direction, hp.lr), transforms=[direction],
                       statistic=statistic, shapes=SCALAR, verify=False)


@register("dpzero", ZerothOrder, defaults={"lr": 0.2})
def dpzero(engine: PerExampleEngine, privatizer: Privatizer, hp: ZerothOrder) -> PrivateStep:
    return _scalar_step(engine, privatizer, hp)


@register("mezo", ZerothOrder, private=False, defaults={"lr": 0.01})
def mezo(engine: PerExampleEngine, privatizer: Privatizer, hp: ZerothOrder) -> PrivateStep:
    plain = NonPrivate(privatizer.clipping, privatizer.noise, privatizer.sampler, privatizer.ledger)
    return _scalar_step(engine, plain, hp)


@register("dpgd-0th", ZerothOrder, defaults={"lr": 0.1})
def dpgd_0th(engine: PerExampleEngine, privatizer: Privatizer, hp: ZerothOrder) -> PrivateStep:
    direction = _direction(engine, hp)

    def statistic(eng: PerExampleEngine, batch: Any) -> DirectionalGradients:
        scalars = finite_differences(eng, batch, direction, hp.smoothing)
        return DirectionalGradients(scalars, direction, eng.groups, direction.step)

    base = torch.optim.SGD(engine.params, lr=hp.lr)
    return PrivateStep(engine, privatizer, base, transforms=[direction], statistic=statistic, verify=False)
