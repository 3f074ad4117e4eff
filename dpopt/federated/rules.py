"""The three methods' update rules, framework-free, vectorised over any number of clients.

Spec ``shared/specs/clip21_sgd2m.md`` §3; paper: Islamov et al., "Double Momentum and Error Feedback for
Clipping with Fast Rates and Differential Privacy" (Alg. 1-3). One client step, for a stack of k clients:

    v_i ← (1-β) v_i + β ∇f_i(x, ξ_i)          (Alg. 3 line 6; v_i = ∇f_i when β = 1)
    δ_i = clip_τ(v_i − g_i)                    (Alg. 3 line 8; Clip-SGD clips ∇f_i itself: no g_i)
    c_i = δ_i + ω_i                            (the message; ω_i is the local DP noise, ``privacy.py``)
    g_i ← g_i + β̂ δ_i                          (Alg. 3 line 9: the shift never sees the noise)

and the server, once per round with the messages that arrived:

    error feedback:  g ← g + (β̂/n) Σ_i c_i       (Alg. 2/3; n = all clients, a silent client sends 0)
    Clip-SGD:        g = (1/m) Σ_i c_i           (Alg. 1; m = clients that reported)
    then             x ← x − γ g

The model moves at the end of the round with the new g. This is Alg. 3 re-indexed: its step
x^{t+1} = x^t − γ g^t opens round t+1, so the points where gradients are taken are the same, and the
model returned after T rounds has used all T messages. Clip21-SGD is Clip21-SGD2M with β = β̂ = 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from dpopt.clipping import Clipping

ALGORITHMS = ("clip-sgd", "clip21-sgd", "clip21-sgd2m")
CLIP_MODES = ("flat", "per-layer")  # one norm for the message, or one per parameter tensor
RENAMED_CLIP_MODES = {"global": "flat", "layerwise": "per-layer"}


def _in_unit_interval(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and 0.0 < value <= 1.0):
        raise ValueError(f"{name} must lie in (0, 1], got {value}")


@dataclass(frozen=True)
class Method:
    """Which method, with its step size γ (server), momentum β and shift/server damping β̂ (clients)."""

    algorithm: str
    lr: float
    beta: float = 1.0
    beta_hat: float = 1.0

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {self.algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"the step size (lr, gamma) must be a finite number > 0, got {self.lr}")
        _in_unit_interval("beta", self.beta)
        _in_unit_interval("beta_hat", self.beta_hat)
        if self.algorithm != "clip21-sgd2m" and (self.beta != 1.0 or self.beta_hat != 1.0):
            raise ValueError(f"{self.algorithm} has no momentum: beta = beta_hat = 1 (Alg. "
                             f"{1 if self.algorithm == 'clip-sgd' else 2}); use clip21-sgd2m to set them")

    @property
    def error_feedback(self) -> bool:
        """Clients keep a shift g_i and the server accumulates g (Clip21-SGD, Clip21-SGD2M)."""
        return self.algorithm != "clip-sgd"

    @property
    def momentum(self) -> bool:
        """Clients keep a momentum buffer v_i (only when β < 1)."""
        return self.beta < 1.0


class MessageClipping:
    """clip_τ over the whole message (``flat``, eq. 4) or over each parameter tensor separately
    (``per-layer``, the paper's layer-wise clipping with the same τ for every block; spec §3.1).

    Built on the core ``Clipping``: layer-wise is its ``per-layer`` mode with bound τ√K, which clips each of
    the K blocks to τ. ``sensitivity`` is the largest norm a message can have before noise: τ, or τ√K."""

    def __init__(self, tau: float, mode: str, block_sizes: Sequence[int]) -> None:
        if not (isinstance(tau, (int, float)) and math.isfinite(tau) and tau > 0):
            raise ValueError(f"the clip radius tau must be a finite number > 0, got {tau}")
        if mode in RENAMED_CLIP_MODES:
            raise ValueError(f"clipping {mode!r} is now {RENAMED_CLIP_MODES[mode]!r}")
        if mode not in CLIP_MODES:
            raise ValueError(f"unknown clipping mode {mode!r}; choose one of {', '.join(CLIP_MODES)}")
        self.tau, self.mode = float(tau), mode
        self.block_sizes = [int(s) for s in block_sizes] if mode == "per-layer" else [sum(block_sizes)]
        blocks = len(self.block_sizes)
        self.core = Clipping(self.tau * math.sqrt(blocks), "per-layer" if blocks > 1 else "flat")

    @property
    def sensitivity(self) -> float:
        return self.core.sensitivity

    def __call__(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The clipped rows of ``rows`` [k, d] and which rows were shrunk [k]. A row with a non-finite
        norm becomes zero (it is neither sent nor added to the shift)."""
        sq = torch.stack([b.square().sum(1) for b in rows.split(self.block_sizes, dim=1)], 1)
        w, finite = self.core.weights(sq, list(range(len(self.block_sizes))))
        scale = w.repeat_interleave(torch.tensor(self.block_sizes, device=rows.device), dim=1)
        clipped = torch.where(finite.unsqueeze(1), rows * scale.to(rows.dtype), torch.zeros_like(rows))
        return clipped, (w < 1.0).any(1)


@dataclass
class ClientUpdate:
    """One client step for k clients: the clipped δ (before noise) and the candidate new state."""

    delta: torch.Tensor
    v: torch.Tensor | None
    g: torch.Tensor | None
    clipped: torch.Tensor


def client_update(method: Method, clipping: MessageClipping, grads: torch.Tensor, v: torch.Tensor | None,
                  g: torch.Tensor | None) -> ClientUpdate:
    """Alg. 1 (client part), Alg. 2 lines 6-7 and Alg. 3 lines 6, 8, 9, for stacked clients [k, d]."""
    v_new = torch.lerp(v, grads, method.beta) if method.momentum else grads
    if not method.error_feedback:
        delta, clipped = clipping(v_new)
        return ClientUpdate(delta, None, None, clipped)
    delta, clipped = clipping(v_new - g)
    return ClientUpdate(delta, v_new if method.momentum else None, g + method.beta_hat * delta, clipped)


@dataclass
class ServerState:
    """The server's model x and direction g (first-class state: it carries β̂ × the summed noise, eq. 16)."""

    x: torch.Tensor
    g: torch.Tensor
    round: int = 0

    @classmethod
    def start(cls, x0: torch.Tensor) -> "ServerState":
        return cls(x0.clone(), torch.zeros_like(x0))

    def apply(self, method: Method, message_sum: torch.Tensor, reported: int, clients: int) -> None:
        """Close a round with the sum of the messages that arrived (``reported`` of ``clients``)."""
        if method.error_feedback:
            self.g.add_(message_sum, alpha=method.beta_hat / clients)
        else:
            self.g = message_sum / reported if reported else torch.zeros_like(self.g)
        self.x.add_(self.g, alpha=-method.lr)
        self.round += 1
