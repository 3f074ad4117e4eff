"""Adam with moments in a projected space (DP-GRAPE, Algorithm 2; GaLore's update).

For a projected weight the moments M, V live in the r-dimensional space of its projection and the step
is lifted back through P: W <- W - alpha_t * P (M / (sqrt(V) + eps)) (left) or (M / (sqrt(V) + eps)) P^T
(right), alpha_t = lr * sqrt(1 - beta2^t) / (1 - beta1^t) (L119-L124). Every other parameter gets the
same formula with full-size moments. A full-size gradient of a projected weight (GaLore, naive DP-GaLore)
is projected first. The paper does not reset the projected moments when the subspace changes (nor does
GaLore): they carry over, expressed in the new basis (spec P11); ``reset_on_refresh`` zeroes them at every
refresh instead, keeping the global step t for bias correction. Weight decay is decoupled.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dpopt.grad.projection import Projection


class ProjectedAdam:
    def __init__(self, params: list[torch.Tensor], projection: Projection, lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0,
                 reset_on_refresh: bool = False) -> None:
        self.params, self.projection = params, projection
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.reset_on_refresh = reset_on_refresh
        self.t = 0
        self.moments: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(params)

    @torch.no_grad()
    def apply(self, grads: list[torch.Tensor]) -> None:
        self.t += 1
        b1, b2 = self.betas
        alpha = self.lr * math.sqrt(1 - b2 ** self.t) / (1 - b1 ** self.t)
        reset = self.reset_on_refresh and self.projection.refreshing
        for i, (p, g) in enumerate(zip(self.params, grads)):
            projected = i in self.projection.sides
            g = g.float()
            if projected and g.shape == p.shape:
                g = self.projection.project_gradient(i, g)
            if self.moments[i] is None:
                self.moments[i] = (torch.zeros_like(g), torch.zeros_like(g))
            m, v = self.moments[i]
            if projected and reset:
                m.zero_()
                v.zero_()
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = v.sqrt().add_(self.eps)
            if self.weight_decay:
                p.mul_(1 - self.lr * self.weight_decay)
            if projected:  # W <- W - alpha * P (M / (sqrt(V) + eps)), one lifted layer alive at a time
                p.add_(self.projection.lift(i, m / denom).to(p.dtype), alpha=-alpha)
            else:
                p.addcdiv_(m.to(p.dtype), denom.to(p.dtype), value=-alpha)

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t, "moments": self.moments}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.t, self.moments = state["t"], state["moments"]
