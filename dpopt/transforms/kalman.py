"""DiSK: the simplified Kalman filter of Zhang et al. (2024), "DiSK: Differentially Private Optimizer with
Simplified Kalman Filter for Noise Reduction", Algorithm 3.

Per step t (lines 4-8):
    v_i = c * grad f(x_t + gamma d_{t-1}; xi_i) + (1 - c) * grad f(x_t; xi_i),   c = (1 - kappa) / (kappa gamma)
    g_t = (sum_i clip(v_i) + noise) / B          (the Privatizer: ONE clip of the mixture, ONE release)
    g~_t = (1 - kappa) g~_{t-1} + kappa g_t      (g~_{-1} = g_0)
    x_{t+1} = BaseUpdate(x_t, g~_t);  d_t = x_{t+1} - x_t   (the actual change: Adam scaling, decay, schedule)

``KalmanFilter`` supplies both the statistic and the filter, so it wraps any base optimizer and any noise
mechanism unchanged. Departures of the published Opacus research code are deliberately not copied: the
noise is not rescaled by 1/sqrt(c^2 + (1-c)^2), gamma = 0 is refused rather than remapped, and the filter
weights kappa on the new observation (Alg. 3, line 6).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dpopt.grad.engine import PerExampleEngine
from dpopt.grad.gradients import PerExampleGradients
from dpopt.transforms.base import Transform


class KalmanFilter(Transform):
    def __init__(self, kappa: float = 0.7, gamma: float = 0.5) -> None:
        if not 0.0 < kappa <= 1.0:
            raise ValueError(f"the Kalman gain kappa must lie in (0, 1], got {kappa}")
        if not (math.isfinite(gamma) and gamma != 0.0):
            raise ValueError(f"gamma must be a finite non-zero number (c = (1-kappa)/(kappa*gamma)), got {gamma}")
        self.kappa, self.gamma = kappa, gamma
        self.c = (1.0 - kappa) / (kappa * gamma)
        self.filtered: list[torch.Tensor] | None = None  # g~
        self.delta: list[torch.Tensor] | None = None  # d, the last parameter change

    @property
    def single_point(self) -> bool:
        """c = 0 (kappa = 1: the base method) or c = 1 (gamma = (1-kappa)/kappa): one gradient per example."""
        return self.c == 0.0 or math.isclose(self.c, 1.0, rel_tol=1e-12)

    def statistic(self, engine: PerExampleEngine, batch: Any) -> PerExampleGradients:
        """Alg. 3, line 5: the per-example mixture, before clipping, both points under the same random draws
        (dropout masks). At t = 0 (d = 0) both points are x_0."""
        if self.delta is None or self.c == 0.0:
            return engine.gradients(batch)
        ahead = [p.detach() + self.gamma * d for p, d in zip(engine.params, self.delta)]
        if self.single_point:
            return engine.gradients(batch, at=ahead)
        with engine.same_random_draws():
            shifted = engine.gradients(batch, at=ahead)
            del ahead  # a model-sized copy: not kept alive through the second pass
            return self.c * shifted + (1.0 - self.c) * engine.gradients(batch)

    def __call__(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Alg. 3, line 6, with g~_{-1} = g_0 (so g~_0 = g_0: g_0 is released once)."""
        if self.filtered is None:
            self.filtered = [g.clone() for g in grads]
        else:
            for f, g in zip(self.filtered, grads):
                f.mul_(1.0 - self.kappa).add_(g, alpha=self.kappa)
        return [f.clone() for f in self.filtered]

    def before_update(self, params: list[torch.Tensor]) -> None:
        if self.c == 0.0:
            return
        if self.delta is None:
            self.delta = [p.detach().clone() for p in params]
        else:
            for d, p in zip(self.delta, params):
                d.copy_(p.detach())

    def after_update(self, params: list[torch.Tensor]) -> None:
        """Alg. 3, line 8: d_t = x_{t+1} - x_t, measured."""
        if self.c == 0.0:
            return
        for d, p in zip(self.delta, params):
            d.neg_().add_(p.detach())

    def state_dict(self) -> dict[str, Any]:
        return {"filtered": self.filtered, "delta": self.delta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.filtered, self.delta = state["filtered"], state["delta"]
