"""The stochastic recursive gradient (SRG) of DP-SRG-MEMF: Choquette-Choo et al. 2024, Algorithm 3
(spec ``dp_srgd.md`` §3.7, errata fixed).

Per step t, on the SAME batch at the current and the previous iterate (line 4):
    Δ_t = (1/B) Σ_i clip(∇ℓ(x_t; d_i) − c·∇ℓ(x_{t−1}; d_i)) + noise     (t = 0: ∇ℓ(x_0; d_i) alone)
    ∇_t = c·∇_{t−1} + Δ̃_t                                              (line 6)
    x_{t+1} = Opt.step(x_t, ∇_t)                                        (line 7: ∇_t, NOT ∇_t + noise again)
The per-example difference is the privatized statistic (one clip, one release per step); the running sum
is post-processing. The chain runs on across epochs; c = 0 is DP-MEMF (Alg. 2) exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from dpopt.grad.engine import PerExampleEngine
from dpopt.grad.gradients import PerExampleGradients
from dpopt.transforms.base import Transform


class RecursiveGradient(Transform):
    def __init__(self, decay: float) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"the SRG decay c must lie in [0, 1), got {decay}")
        self.decay = float(decay)
        self.previous: list[torch.Tensor] | None = None  # x_{t-1}
        self.running: list[torch.Tensor] | None = None  # ∇_{t-1}

    def statistic(self, engine: PerExampleEngine, batch: Any) -> PerExampleGradients:
        """Line 4: the per-example difference, before clipping (one evaluation where c = 0 or t = 0); both
        points see the same random draws (dropout masks)."""
        if self.previous is None or self.decay == 0.0:
            return engine.gradients(batch)
        with engine.same_random_draws():
            return engine.gradients(batch) - self.decay * engine.gradients(batch, at=self.previous)

    def __call__(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Line 6, with ∇_{-1} = 0."""
        if self.running is None:
            self.running = [g.clone() for g in grads]
        else:
            for r, g in zip(self.running, grads):
                r.mul_(self.decay).add_(g)
        return [r.clone() for r in self.running]

    def before_update(self, params: list[torch.Tensor]) -> None:
        if self.decay == 0.0:
            return
        self.previous = [p.detach().clone() for p in params]

    def state_dict(self) -> dict[str, Any]:
        return {"previous": self.previous, "running": self.running}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.previous, self.running = state["previous"], state["running"]
