"""The hyper-parameters of the recipes, one small typed config per family: each recipe takes the config of its
family (``CONFIGS``), so a setting that does not apply to it cannot be given to it.

    Hyperparameters          lr
    ├── SGD                  + momentum, weight_decay          dp-sgd, dp-ftrl, dp-memf
    │   ├── SRG              + decay                           dp-srg-memf
    │   └── DiSKSGD          + kappa, gamma                    disk-sgd
    ├── Adam                 + betas, eps, weight_decay        dp-adam, dp-adamw
    │   ├── DiSKAdam         + kappa, gamma                    disk-adam, disk-adamw
    │   └── Projection       + rank, subspace_every, ...       dp-grape, dp-galore
    │       └── DiSKProjection  + kappa, gamma                 disk-grape
    ├── SRGD                 + radius, statistic_scale         accel-dp-srgd, dp-srgd
    └── ZerothOrder          + smoothing, direction, ...       dpzero, dpgd-0th, mezo

Every field becomes a ``dpopt train`` flag; its help is the field's ``help`` metadata.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

from dpopt.grad.zeroth_order import DIRECTION_LAWS


def hyper(default: Any, help: str) -> Any:  # noqa: A002
    """A hyper-parameter field; its help text becomes the ``dpopt train`` flag's help."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class StepRule:
    """A default set by the run's length T: ``scale / T**power``, at most ``cap`` where given (a number, or
    another rule of T) and at least ``floor``. Accelerated-DP-SRGD's step must shrink like 1/T (Claim 4.2: power
    1), and like T^(-3/2) on long runs (Thm 4.10's β); Adam's noise-driven walk grows like lr * sqrt(T) (power
    1/2); Accelerated-DP-SRGD's statistic scale grows like T past 938 steps (power -1, floor 1)."""

    scale: float
    power: float
    cap: "float | StepRule | None" = None
    floor: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.cap, dict):  # a rule read back from a config (to_dict's asdict)
            object.__setattr__(self, "cap", StepRule(**self.cap))

    def __call__(self, steps: int) -> float:
        lr = self.scale / steps ** self.power
        if self.cap is not None:
            lr = min(self.cap(steps) if isinstance(self.cap, StepRule) else self.cap, lr)
        return lr if self.floor is None else max(self.floor, lr)

    def __str__(self) -> str:
        rule = (f"steps/{1 / self.scale:g}" if self.power == -1.0 else
                f"{self.scale:g}/" + {1.0: "steps", 0.5: "sqrt(steps)"}.get(self.power, f"steps^{self.power:g}"))
        if self.cap is not None:
            rule = f"min({self.cap if isinstance(self.cap, StepRule) else format(self.cap, 'g')}, {rule})"
        return rule if self.floor is None else f"max({self.floor:g}, {rule})"


def _positive_or_rule(value: Any) -> bool:
    """A field that may be a run-length rule: the rule, or a finite number > 0."""
    return isinstance(value, StepRule) or (isinstance(value, (int, float)) and math.isfinite(value) and value > 0)


def _finite_positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


# Each field's check and its error (the same words as the parts that use the field check them with).
CHECKS: dict[str, tuple[Callable[[Any], bool], Callable[[Any], str]]] = {
    "lr": (_positive_or_rule, lambda v: f"the learning rate must be a finite number > 0, got {v}"),
    "momentum": (lambda v: 0.0 <= v < 1.0, lambda v: f"momentum must lie in [0, 1), got {v}"),
    "weight_decay": (lambda v: v >= 0, lambda v: f"weight decay must be >= 0, got {v}"),
    "betas": (lambda v: len(v) == 2 and all(0.0 <= b < 1.0 for b in v),
              lambda v: f"Adam betas must be two numbers in [0, 1), got {v}"),
    "eps": (_finite_positive, lambda v: f"Adam epsilon must be a finite number > 0, got {v}"),
    "kappa": (lambda v: 0.0 < v <= 1.0, lambda v: f"the Kalman gain kappa must lie in (0, 1], got {v}"),
    "gamma": (lambda v: math.isfinite(v) and v != 0.0,
              lambda v: f"gamma must be a finite non-zero number (c = (1-kappa)/(kappa*gamma)), got {v}"),
    "rank": (lambda v: v >= 1, lambda v: f"the projection rank must be >= 1, got {v}"),
    "subspace_every": (lambda v: v >= 1, lambda v: f"the subspace must be refreshed every >= 1 steps, got {v}"),
    "decay": (lambda v: 0.0 <= v < 1.0, lambda v: f"the SRG decay c must lie in [0, 1), got {v}"),
    "radius": (lambda v: math.isfinite(v) and v >= 0.0,
               lambda v: f"the constraint radius must be a finite number >= 0 (0: unconstrained), got {v}"),
    "statistic_scale": (_positive_or_rule, lambda v: f"the statistic scale must be a finite number > 0, got {v}"),
    "smoothing": (_finite_positive, lambda v: f"the smoothing lambda must be a finite number > 0, got {v}"),
    "direction": (lambda v: v in DIRECTION_LAWS,
                  lambda v: f"unknown direction law {v!r}; choose one of {', '.join(DIRECTION_LAWS)}"),
}


@dataclass(frozen=True)
class Hyperparameters:
    """What every recipe takes: the learning rate (a ``StepRule``: set by the run's length, ``for_run``)."""

    lr: float | StepRule = hyper(0.5, "learning rate")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):  # read back from JSON
                object.__setattr__(self, f.name, value := tuple(value))
            if f.name in CHECKS and not CHECKS[f.name][0](value):
                raise ValueError(CHECKS[f.name][1](value))

    def rules(self) -> dict[str, StepRule]:
        """The fields still given as a ``StepRule`` of the run's length (a recipe's default)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), StepRule)}

    def for_run(self, steps: int) -> "Hyperparameters":
        """These hyper-parameters over a run of ``steps`` steps: each field given as a ``StepRule`` becomes its
        value for that length."""
        return replace(self, **{name: rule(steps) for name, rule in self.rules().items()})


@dataclass(frozen=True)
class SGD(Hyperparameters):
    """SGD as the base update (``torch.optim.SGD``)."""

    momentum: float = hyper(0.0, "SGD momentum")
    weight_decay: float = hyper(0.0, "weight decay (decoupled for dp-adamw)")


@dataclass(frozen=True)
class Adam(Hyperparameters):
    """Adam or AdamW as the base update."""

    betas: tuple[float, float] = hyper((0.9, 0.999), "Adam betas")
    eps: float = hyper(1e-8, "Adam epsilon")
    weight_decay: float = hyper(0.0, "weight decay (decoupled for dp-adamw)")


@dataclass(frozen=True)
class Kalman:
    """DiSK's Kalman filter (Zhang et al. 2024, Alg. 3): the gain and the extrapolation step."""

    kappa: float = hyper(0.7, "DiSK Kalman gain: weight of the new privatized gradient")
    gamma: float = hyper(0.5, "DiSK extrapolation step: second point x + gamma * d")


@dataclass(frozen=True)
class Projection(Adam):
    """DP-GRAPE's and DP-GaLore's projected Adam."""

    rank: int = hyper(16, "projection rank r")
    subspace_every: int = hyper(100, "refresh the projection subspace every F steps")
    projection_seed: int = hyper(0, "public seed of DP-GRAPE's random projections (safe to publish)")
    projection_exclude: str = hyper("head,classifier,lm_head", "comma-separated module-name parts whose Linear "
                                    "weights are not projected")
    reset_moments: bool = hyper(False, "zero the projected Adam moments at every subspace refresh; the paper keeps "
                                "them")


@dataclass(frozen=True)
class DiSKSGD(SGD, Kalman):
    """DiSK on SGD."""


@dataclass(frozen=True)
class DiSKAdam(Adam, Kalman):
    """DiSK on Adam or AdamW."""


@dataclass(frozen=True)
class DiSKProjection(Projection, Kalman):
    """DiSK on DP-GRAPE's projected Adam."""


@dataclass(frozen=True)
class SRG(SGD):
    """Momentum SGD on the privatized SRG increments (DP-SRG-MEMF, Alg. 3)."""

    decay: float = hyper(math.exp(-2.5), "SRG decay c: statistic grad(x_t) - c grad(x_t-1), running sum "
                         "g_t = c g_t-1 + noisy increment (0 is dp-memf)")


@dataclass(frozen=True)
class SRGD(Hyperparameters):
    """(Accelerated-)DP-SRGD (Alg. 1): ``lr`` is 1/beta."""

    radius: float = hyper(0.0, "L2-ball constraint radius around the initial point, 0 for none")
    statistic_scale: float | StepRule = hyper(1.0, "the two-point statistic is divided by it before the clip: "
                                              "clipped at scale * C, a step of lr / scale in C's units")


@dataclass(frozen=True)
class ZerothOrder(Hyperparameters):
    """Forward-only finite differences along public random directions (DPZero, DPGD-0th, MeZO)."""

    smoothing: float = hyper(1e-3, "zeroth-order smoothing lambda: losses at x +/- lambda*u")
    direction: str = hyper("gaussian", "law of the zeroth-order direction u: gaussian N(0, I) or sphere of radius "
                                       "sqrt(d)")
    direction_seed: int = hyper(0, "public seed of the zeroth-order directions (safe to publish)")


def all_fields() -> dict[str, Any]:
    """Every family's fields by name (each becomes a ``dpopt train`` flag), in a stable order."""
    found: dict[str, Any] = {}
    for cls in (Hyperparameters, SGD, Adam, Kalman, Projection, SRG, SRGD, ZerothOrder):
        for f in fields(cls):
            found.setdefault(f.name, f)
    return found
