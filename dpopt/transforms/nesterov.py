"""The base update of Accelerated-DP-SRGD: Choquette-Choo et al. 2024, Algorithm 1 (L94-L105), in the
implementable form of spec ``dp_srgd.md`` §3.3, and its unaccelerated variant (Sec. 4.3, L214-L220).

With weights η_t = t + 1 and 1/β = ``lr``, per step t, on the SAME batch at x_t and x_{t−1} (line 3):
    u_i = (η_t ∇f(x_t; d_i) − η_{t−1} ∇f(x_{t−1}; d_i)) / s   (t = 0: η_0 ∇f(x_0; d_i) / s); clipped per example
    Δ̃_t = (Σ_i clip(u_i) + noise_t) / B                    (the Privatizer; the noise is correlated: prefix
                                                             sums of the Δ̃ are a continual-counting release)
    S̃_t = Σ_{i≤t} Δ̃_i                                      (= η_t ∇̃_t, line 4)
    z_{t+1} = Π(z_t − S̃_t/β),  y_{t+1} = Π(x_t − S̃_t/(η_t β))     (lines 5-6: the same noise in both)
    x_{t+1} = (1 − τ_{t+1}) y_{t+1} + τ_{t+1} z_{t+1},  τ_t = η_t / η_{0:t} = 2/(t+2)   (line 7)
Π projects onto the L2 ball of ``radius`` around the initial point (the paper's 𝒞 ∋ x_0 = 0; radius 0: no
constraint). The scale s (``scale``, 1 in the paper) is dpopt's: clipping u_i at C is clipping the paper's statistic
at s·C with a step 1/(sβ) in C's units, the same noise in x (docs/defaults.md). The model holds y (the output,
L105); the gradients are taken at x and x_{t−1} through the engine's ``at=``. ``accelerate=False`` sets τ ≡ 0 (x =
y): projected SGD with the SRG estimate.
"""

from __future__ import annotations

from typing import Any

import torch

from dpopt.grad.engine import PerExampleEngine
from dpopt.grad.gradients import PerExampleGradients


def _project(v: list[torch.Tensor], center: list[torch.Tensor], radius: float) -> None:
    """In place: v <- the nearest point of the ball {‖v − center‖₂ <= radius} (no-op for radius 0)."""
    if radius <= 0.0:
        return
    dist = torch.sqrt(sum(((a - c) ** 2).sum() for a, c in zip(v, center)))
    if float(dist) > radius:
        for a, c in zip(v, center):
            a.sub_(c).mul_(radius / dist).add_(c)


class AcceleratedSRG:
    def __init__(self, params: list[torch.Tensor], lr: float, radius: float = 0.0, accelerate: bool = True,
                 scale: float = 1.0) -> None:
        if not lr > 0.0:
            raise ValueError(f"the step 1/beta (lr) must be > 0, got {lr}")
        if not scale > 0.0:
            raise ValueError(f"the statistic scale must be > 0, got {scale}")
        if radius < 0.0:
            raise ValueError(f"the constraint radius must be >= 0 (0: unconstrained), got {radius}")
        self.params, self.lr, self.radius, self.accelerate = params, float(lr), float(radius), accelerate
        self.scale = float(scale)
        self.center = [p.detach().clone() for p in params]
        self.x = [p.detach().clone() for p in params]
        self.z = [p.detach().clone() for p in params]
        self.x_prev: list[torch.Tensor] | None = None
        self.prefix = [torch.zeros_like(p, dtype=torch.float32 if p.dtype != torch.float64 else p.dtype)
                       for p in params]
        self.t = 0

    def statistic(self, engine: PerExampleEngine, batch: Any) -> PerExampleGradients:
        """Line 3 per example, divided by ``scale`` (so clipped at scale * C, and each step lr / scale in C's units):
        two evaluations on the same batch and random draws (dropout masks), whose η-weighted difference would
        otherwise carry t times the masks' difference (one at t = 0: η_{-1} = 0)."""
        eta = float(self.t + 1)
        if self.x_prev is None:
            return (eta / self.scale) * engine.gradients(batch, at=self.x)
        with engine.same_random_draws():
            return ((eta / self.scale) * engine.gradients(batch, at=self.x)
                    - ((eta - 1.0) / self.scale) * engine.gradients(batch, at=self.x_prev))

    def apply(self, grads: list[torch.Tensor]) -> None:
        """Lines 4-7 from the privatized Δ̃_t; the model's parameters become y_{t+1}."""
        eta = float(self.t + 1)
        for s, g in zip(self.prefix, grads):
            s.add_(g.to(s.dtype))
        for z, s in zip(self.z, self.prefix):
            z.sub_(s.to(z.dtype), alpha=self.lr)
        _project(self.z, self.center, self.radius)
        y = [x - (self.lr / eta) * s.to(x.dtype) for x, s in zip(self.x, self.prefix)]
        _project(y, self.center, self.radius)
        tau = 2.0 / (self.t + 3) if self.accelerate else 0.0  # τ_{t+1} = η_{t+1}/η_{0:t+1}
        self.x_prev = self.x
        self.x = [(1.0 - tau) * a + tau * b for a, b in zip(y, self.z)]
        with torch.no_grad():
            for p, a in zip(self.params, y):
                p.copy_(a)
        self.t += 1

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t, "center": self.center, "x": self.x, "z": self.z, "x_prev": self.x_prev,
                "prefix": self.prefix}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.t = state["t"]
        self.center, self.x, self.z, self.x_prev, self.prefix = (state[k] for k in
                                                                 ("center", "x", "z", "x_prev", "prefix"))
