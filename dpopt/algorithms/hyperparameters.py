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
    1/2); Accelerated-DP-SRGD's statistic scale grows like T past 938 steps (power -1, floor 1).

    A recipe's tuned ``lr`` is often a rule; ``Hyperparameters.for_run(steps)`` turns every rule into its number
    (``make_private`` and ``dpopt train`` do it once the run's length is known). ``str(rule)`` is how
    ``dpopt train --help`` and the recipes page write it.

    ```python
    from dpopt import StepRule

    rule = StepRule(0.15, 0.5)                  # 0.15 / sqrt(T): DP-Adam's default learning rate
    assert str(rule) == "0.15/sqrt(steps)"
    assert abs(rule(100) - 0.015) < 1e-12
    capped = StepRule(3.1, 0.5, cap=0.2, floor=0.1)   # min(0.2, 3.1 / sqrt(T)), at least 0.1
    assert capped(1) == 0.2 and capped(10_000) == 0.1
    ```

    :param scale: the numerator, in the unit of the field it sets.
    :param power: T's exponent (1: like 1/T, 0.5: like 1/sqrt(T), -1: grows like T).
    :param cap: an upper bound: a number, another ``StepRule`` of T, or None (no bound).
    :param floor: a lower bound, or None (no bound).
    """

    scale: float
    power: float
    cap: "float | StepRule | None" = None
    floor: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.cap, dict):  # a rule read back from a config (to_dict's asdict)
            object.__setattr__(self, "cap", StepRule(**self.cap))

    def __call__(self, steps: int) -> float:
        """The value over a run of ``steps`` logical steps.

        :param steps: the run's length T (>= 1).
        :returns: ``scale / steps**power``, capped and floored.
        """
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
    """What every recipe takes: the learning rate. The base of one typed config per family; a recipe takes
    exactly its family's (``hyperparameters_for(name)`` builds it with the recipe's tuned defaults), so a
    setting that does not apply to a recipe cannot be given to it. Every field is checked when the config is
    built, and becomes a ``dpopt train`` flag.

    ```python
    from dpopt import SGD, Hyperparameters, StepRule, hyperparameters_for

    hp = hyperparameters_for("dp-adam")         # Adam, with the recipe's lr = 0.15 / sqrt(steps)
    assert hp.rules() == {"lr": StepRule(0.15, 0.5)}
    assert hp.for_run(400).lr == StepRule(0.15, 0.5)(400) and not hp.for_run(400).rules()
    assert isinstance(SGD(lr=0.1), Hyperparameters)
    try:
        SGD(lr=-1.0)
    except ValueError as e:
        error = str(e)
    assert error == "the learning rate must be a finite number > 0, got -1.0"
    ```

    :param lr: the learning rate (> 0, finite), or a ``StepRule`` of the run's length.
    :raises ValueError: for a field out of its range (the message names the field and the range).
    """

    lr: float | StepRule = hyper(0.5, "learning rate")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):  # read back from JSON
                object.__setattr__(self, f.name, value := tuple(value))
            if f.name in CHECKS and not CHECKS[f.name][0](value):
                raise ValueError(CHECKS[f.name][1](value))

    def rules(self) -> dict[str, StepRule]:
        """The fields still given as a ``StepRule`` of the run's length (a recipe's default).

        :returns: each such field's name and its rule; empty once ``for_run`` resolved them.
        """
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), StepRule)}

    def for_run(self, steps: int) -> "Hyperparameters":
        """These hyper-parameters over a run of ``steps`` steps: each field given as a ``StepRule`` becomes its
        value for that length.

        :param steps: the run's length in logical steps.
        :returns: a copy of the same config with numbers in place of the rules.
        :raises ValueError: where a rule's value falls out of its field's range.
        """
        return replace(self, **{name: rule(steps) for name, rule in self.rules().items()})


@dataclass(frozen=True)
class SGD(Hyperparameters):
    """SGD as the base update (``torch.optim.SGD``): the config of ``dp-sgd`` (Abadi et al. 2016, Alg. 1),
    ``dp-ftrl`` (tree-aggregated noise, Kairouz et al. 2021) and ``dp-memf`` (matrix-factorization noise with
    momentum: Choquette-Choo, Ganesh, Thakurta 2024, Alg. 2).

    ```python
    from dpopt import SGD, hyperparameters_for

    hp = hyperparameters_for("dp-ftrl")         # the recipe's tuned momentum 0.9
    assert isinstance(hp, SGD) and hp.momentum == 0.9
    ```

    :param lr: the learning rate (> 0), or a ``StepRule``; default 0.5.
    :param momentum: heavy-ball momentum, in [0, 1); default 0 (none).
    :param weight_decay: L2 weight decay (>= 0), added to the released gradient as ``torch.optim.SGD`` does;
        default 0.
    :raises ValueError: for a field out of its range.
    """

    momentum: float = hyper(0.0, "SGD momentum")
    weight_decay: float = hyper(0.0, "weight decay (decoupled for dp-adamw)")


@dataclass(frozen=True)
class Adam(Hyperparameters):
    """Adam or AdamW as the base update: the config of ``dp-adam`` (``torch.optim.Adam`` on the released
    gradient) and ``dp-adamw`` (``torch.optim.AdamW``).

    :param lr: the learning rate (> 0), or a ``StepRule``; the recipes' default is 0.15 / sqrt(steps).
    :param betas: the moments' decay rates, two numbers in [0, 1); default (0.9, 0.999).
    :param eps: the denominator's term (> 0, finite); default 1e-8.
    :param weight_decay: weight decay (>= 0): decoupled for ``dp-adamw``, L2 for ``dp-adam``; default 0.
    :raises ValueError: for a field out of its range.
    """

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
    """DP-GRAPE's and DP-GaLore's projected Adam: the config of ``dp-grape`` (Mulrooney et al., DP-GRAPE,
    Alg. 1: each Linear weight's per-example gradient projected by a public random matrix P to rank r before it is
    clipped and noised, Adam's moments kept in the projected space and the step lifted back by P, Alg. 2) and
    ``dp-galore`` (naive DP-GaLore, Alg. 5: SVD projections of the privatized gradient).

    ```python
    from dpopt import Projection, hyperparameters_for

    hp = hyperparameters_for("dp-grape", rank=8, subspace_every=50)
    assert isinstance(hp, Projection) and (hp.rank, hp.subspace_every, hp.betas) == (8, 50, (0.9, 0.999))
    ```

    :param lr: the learning rate (> 0), or a ``StepRule``; the recipes' default is 0.15 / sqrt(steps)
        (``dp-grape``) and 0.3 / sqrt(steps) (``dp-galore``).
    :param betas: Adam's moments' decay rates, in [0, 1).
    :param eps: Adam's denominator's term (> 0).
    :param weight_decay: weight decay (>= 0).
    :param rank: the projection rank r (>= 1); default 16.
    :param subspace_every: refresh the projection every F steps (>= 1); default 100.
    :param projection_seed: the public seed of DP-GRAPE's random projections (not secret: P carries no data).
    :param projection_exclude: comma-separated module-name parts whose Linear weights are updated in full
        (not projected); default ``"head,classifier,lm_head"``.
    :param reset_moments: zero the projected moments at each refresh (the paper keeps them); default False.
    :raises ValueError: for a field out of its range.
    """

    rank: int = hyper(16, "projection rank r")
    subspace_every: int = hyper(100, "refresh the projection subspace every F steps")
    projection_seed: int = hyper(0, "public seed of DP-GRAPE's random projections (safe to publish)")
    projection_exclude: str = hyper("head,classifier,lm_head", "comma-separated module-name parts whose Linear "
                                    "weights are not projected")
    reset_moments: bool = hyper(False, "zero the projected Adam moments at every subspace refresh; the paper keeps "
                                "them")


@dataclass(frozen=True)
class DiSKSGD(SGD, Kalman):
    """DiSK on SGD: the config of ``disk-sgd``. DiSK (Zhang et al. 2024, Alg. 3) filters the privatized gradient
    with a Kalman filter of constant gain κ; each example's statistic is
    ``c * grad f(x + γ d) + (1 - c) * grad f(x)`` with ``c = (1 - κ) / (κ γ)`` (lines 4-6), clipped and noised
    once, then SGD steps on the filtered gradient (line 8).

    :param lr: SGD's learning rate (> 0), or a ``StepRule``.
    :param momentum: SGD's momentum, in [0, 1).
    :param weight_decay: weight decay (>= 0).
    :param kappa: the Kalman gain κ in (0, 1]: the weight of the new privatized gradient (1: no filter, plain
        DP-SGD); default 0.7.
    :param gamma: the extrapolation step γ (finite, non-zero): the second point is x + γ d; default 0.5.
    :raises ValueError: for a field out of its range.
    """


@dataclass(frozen=True)
class DiSKAdam(Adam, Kalman):
    """DiSK on Adam or AdamW: the config of ``disk-adam`` and ``disk-adamw`` (Zhang et al. 2024, Alg. 3 with
    Adam as the base update; ``DiSKSGD`` has the filter).

    ```python
    from dpopt import DiSKAdam, hyperparameters_for

    hp = hyperparameters_for("disk-adam", kappa=0.5, gamma=1.0)
    assert isinstance(hp, DiSKAdam) and hp.kappa == 0.5
    try:
        hyperparameters_for("disk-adam", kappa=0.0)
    except ValueError as e:
        error = str(e)
    assert error == "the Kalman gain kappa must lie in (0, 1], got 0.0"
    ```

    :param lr: Adam's learning rate (> 0), or a ``StepRule``; the recipes' default is 0.15 / sqrt(steps).
    :param betas: Adam's moments' decay rates, in [0, 1).
    :param eps: Adam's denominator's term (> 0).
    :param weight_decay: weight decay (>= 0; decoupled for ``disk-adamw``).
    :param kappa: the Kalman gain κ in (0, 1]; default 0.7.
    :param gamma: the extrapolation step γ (finite, non-zero); default 0.5.
    :raises ValueError: for a field out of its range.
    """


@dataclass(frozen=True)
class DiSKProjection(Projection, Kalman):
    """DiSK on DP-GRAPE's projected Adam: the config of ``disk-grape``: DiSK's filter (``DiSKSGD``) on the
    projected per-example gradients of ``Projection``.

    :param lr: the learning rate (> 0), or a ``StepRule``.
    :param betas: Adam's moments' decay rates, in [0, 1).
    :param eps: Adam's denominator's term (> 0).
    :param weight_decay: weight decay (>= 0).
    :param rank: the projection rank r (>= 1).
    :param subspace_every: refresh the projection every F steps (>= 1).
    :param projection_seed: the public seed of the random projections.
    :param projection_exclude: comma-separated module-name parts whose Linear weights are not projected.
    :param reset_moments: zero the projected moments at each refresh.
    :param kappa: the Kalman gain κ in (0, 1].
    :param gamma: the extrapolation step γ (finite, non-zero).
    :raises ValueError: for a field out of its range.
    """


@dataclass(frozen=True)
class SRG(SGD):
    """Momentum SGD on the privatized SRG increments: the config of ``dp-srg-memf`` (Choquette-Choo, Ganesh,
    Thakurta 2024, DP-SRG-MEMF, Alg. 3). Each example's statistic is ``grad f(x_t) - c grad f(x_t-1)``; the
    running sum ``g_t = c g_t-1 + noisy increment`` estimates the gradient under matrix-factorization noise.

    :param lr: the learning rate (> 0), or a ``StepRule``; the recipe's default is 0.3.
    :param momentum: SGD's momentum, in [0, 1).
    :param weight_decay: weight decay (>= 0).
    :param decay: the SRG decay c, in [0, 1) (0 is ``dp-memf``); default exp(-2.5).
    :raises ValueError: for a field out of its range.
    """

    decay: float = hyper(math.exp(-2.5), "SRG decay c: statistic grad(x_t) - c grad(x_t-1), running sum "
                         "g_t = c g_t-1 + noisy increment (0 is dp-memf)")


@dataclass(frozen=True)
class SRGD(Hyperparameters):
    """(Accelerated-)DP-SRGD: the config of ``accel-dp-srgd`` (Choquette-Choo, Ganesh, Thakurta 2024, Alg. 1:
    Nesterov coupling on the prefix sums of the SRG statistics, under tree noise) and ``dp-srgd`` (the same without
    acceleration, Sec. 4.3).

    ```python
    from dpopt import SRGD, hyperparameters_for

    hp = hyperparameters_for("accel-dp-srgd", radius=2.0)
    assert isinstance(hp, SRGD) and set(hp.rules()) == {"lr", "statistic_scale"}   # both set by the run's length
    ```

    :param lr: the step 1/β (> 0), or a ``StepRule`` (``accel-dp-srgd``'s default shrinks like T^(-3/2), Thm 4.10,
        at most 1.1/T, Claim 4.2).
    :param radius: the radius of the L2 ball around the initial point that the iterates are projected onto
        (finite, >= 0; 0: unconstrained); default 0.
    :param statistic_scale: the two-point statistic is divided by it before the clip, so it is clipped at
        ``scale * C`` and a step moves ``lr / scale`` in C's units (> 0, or a ``StepRule``); default 1.
    :raises ValueError: for a field out of its range.
    """

    radius: float = hyper(0.0, "L2-ball constraint radius around the initial point, 0 for none")
    statistic_scale: float | StepRule = hyper(1.0, "the two-point statistic is divided by it before the clip: "
                                              "clipped at scale * C, a step of lr / scale in C's units")


@dataclass(frozen=True)
class ZerothOrder(Hyperparameters):
    """Forward-only finite differences along public random directions: the config of ``dpzero`` (Zhang et al.
    2024, DPZero, Alg. 2: each example's scalar ``s_i = (f(x + λu) - f(x - λu)) / 2λ``, Eq. 2, clipped to
    [-C, C] and noised as one number), ``dpgd-0th`` (Alg. 1: the vector ``s_i u`` clipped and noised) and ``mezo``
    (Malladi et al. 2023; not private: a baseline).

    ```python
    from dpopt import ZerothOrder, hyperparameters_for

    hp = hyperparameters_for("dpzero", smoothing=1e-2, direction="sphere")
    assert isinstance(hp, ZerothOrder) and hp.lr == 0.2        # the recipe's tuned default
    ```

    :param lr: the learning rate (> 0), or a ``StepRule``; the recipes' defaults are 0.2 (``dpzero``), 0.1
        (``dpgd-0th``) and 0.01 (``mezo``).
    :param smoothing: λ (> 0, finite): the losses are taken at x ± λu; default 1e-3.
    :param direction: the law of u: ``gaussian`` (N(0, I)) or ``sphere`` (uniform, radius sqrt(d)).
    :param direction_seed: the public seed of the directions (not secret: u carries no data).
    :raises ValueError: for a field out of its range or an unknown direction law.
    """

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
