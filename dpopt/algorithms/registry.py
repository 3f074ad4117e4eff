"""The named recipes: each is a short function that picks the parts of the private step."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

from dpopt.algorithms.base import DPOptimizer, Privatizer
from dpopt.grad.engine import PerExampleEngine
from dpopt.grad.zeroth_order import DIRECTION_LAWS


def hyper(default, help: str):  # noqa: A002
    """A hyper-parameter field; its help text becomes the ``dpopt train`` flag's help."""
    return field(default=default, metadata={"help": help})


WORKLOADS = ("ones", "true")
TREE_DECODERS = ("sum", "least-squares")


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


@dataclass(frozen=True)
class Hyperparameters:
    """The optimisation hyper-parameters of every recipe; each becomes a ``dpopt train`` flag.
    A recipe reads the fields it needs; a new method adds its own fields here."""

    lr: float | StepRule = hyper(0.5, "learning rate")  # a StepRule: set by the run's length (for_run)
    momentum: float = hyper(0.0, "SGD momentum of the SGD-based recipes (dp-ftrl's default: 0.9)")
    weight_decay: float = hyper(0.0, "weight decay (decoupled for dp-adamw)")
    betas: tuple[float, float] = hyper((0.9, 0.999), "Adam betas")
    eps: float = hyper(1e-8, "Adam epsilon")
    kappa: float = hyper(0.7, "DiSK Kalman gain: weight of the new privatized gradient (disk-*)")
    gamma: float = hyper(0.5, "DiSK extrapolation step: second point x + gamma * d (disk-*)")
    rank: int = hyper(16, "projection rank r (dp-grape, dp-galore)")
    subspace_every: int = hyper(100, "refresh the projection subspace every F steps (dp-grape, dp-galore)")
    projection_seed: int = hyper(0, "public seed of DP-GRAPE's random projections (safe to publish)")
    projection_exclude: str = hyper("head,classifier,lm_head", "comma-separated module-name parts whose Linear "
                                    "weights are not projected (dp-grape, dp-galore)")
    reset_moments: bool = hyper(False, "zero the projected Adam moments at every subspace refresh; the paper "
                                "keeps them (dp-grape, dp-galore)")
    decay: float = hyper(math.exp(-2.5), "SRG decay c: statistic grad(x_t) - c grad(x_t-1), running sum "
                         "g_t = c g_t-1 + noisy increment (dp-srg-memf; 0 is dp-memf)")
    radius: float = hyper(0.0, "L2-ball constraint radius around the initial point, 0 for none "
                          "(accel-dp-srgd, dp-srgd; there lr is 1/beta)")
    statistic_scale: float | StepRule = hyper(1.0, "the two-point statistic is divided by it before the clip: "
                                              "clipped at scale * C, a step of lr / scale in C's units "
                                              "(accel-dp-srgd, dp-srgd)")
    workload: str = hyper("ones", "workload the optimised factorization targets (--noise mf, banded): ones "
                          "(prefix sums) or true (with --momentum and, for dp-srg-memf, --decay)")
    bands: int = hyper(0, "bands of --noise banded/sqrt, and the period of --sampling cyclic (0: one epoch's steps "
                          "for banded, all for sqrt; under cyclic sampling, chosen for the epsilon)")
    tree_decoder: str = hyper("sum", "--noise tree: sum (dyadic decomposition) or least-squares")
    smoothing: float = hyper(1e-3, "zeroth-order smoothing lambda: losses at x +/- lambda*u (dpzero, dpgd-0th, mezo)")
    direction: str = hyper("gaussian", "law of the zeroth-order direction u: gaussian N(0, I) or sphere of radius "
                                       "sqrt(d) (dpzero, dpgd-0th, mezo)")
    direction_seed: int = hyper(0, "public seed of the zeroth-order directions (dpzero, dpgd-0th, mezo; "
                                   "safe to publish)")

    def __post_init__(self) -> None:
        if not _positive_or_rule(self.lr):
            raise ValueError(f"learning rate must be a finite number > 0, got {self.lr}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must lie in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ValueError(f"weight decay must be >= 0, got {self.weight_decay}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"Adam betas must lie in [0, 1), got {self.betas}")
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"the SRG decay c must lie in [0, 1), got {self.decay}")
        if not _positive_or_rule(self.statistic_scale):
            raise ValueError(f"the statistic scale must be a finite number > 0, got {self.statistic_scale}")
        if not (math.isfinite(self.radius) and self.radius >= 0.0):
            raise ValueError(f"the constraint radius must be a finite number >= 0 (0: unconstrained), "
                             f"got {self.radius}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; choose one of {', '.join(WORKLOADS)}")
        if self.bands < 0:
            raise ValueError(f"bands must be >= 0 (0: the mechanism's default), got {self.bands}")
        if self.tree_decoder not in TREE_DECODERS:
            raise ValueError(f"unknown tree decoder {self.tree_decoder!r}; choose one of {', '.join(TREE_DECODERS)}")
        if not (math.isfinite(self.smoothing) and self.smoothing > 0):
            raise ValueError(f"the smoothing lambda must be a finite number > 0, got {self.smoothing}")
        if self.direction not in DIRECTION_LAWS:
            raise ValueError(f"unknown direction law {self.direction!r}; choose one of {', '.join(DIRECTION_LAWS)}")

    @classmethod
    def for_algorithm(cls, name: str, **overrides: Any) -> "Hyperparameters":
        """The hyper-parameters of recipe ``name``: its tuned defaults (``register(defaults=...)``), then the
        fields of this class, with ``overrides`` (those not None) on top."""
        given = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items() if v is not None}
        return cls(**{**DEFAULTS.get(name, {}), **given})

    def rules(self) -> dict[str, StepRule]:
        """The fields still given as a ``StepRule`` of the run's length (a recipe's default)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), StepRule)}

    def for_run(self, steps: int) -> "Hyperparameters":
        """These hyper-parameters over a run of ``steps`` steps: each field given as a ``StepRule`` becomes its
        value for that length."""
        return replace(self, **{name: rule(steps) for name, rule in self.rules().items()})


Recipe = Callable[[PerExampleEngine, Privatizer, Hyperparameters], DPOptimizer]
ALGORITHMS: dict[str, Recipe] = {}
DEFAULT_NOISE: dict[str, str] = {}  # a recipe's noise mechanism unless --noise says otherwise
DEFAULT_SAMPLING: dict[str, str] = {}  # a recipe's sampling with its own noise, unless --sampling says otherwise
DECAYED_WORKLOAD: set[str] = set()  # recipes that privatize SRG increments: their "true" workload has --decay
NON_PRIVATE: set[str] = set()  # baselines that release without noise: no privacy target, epsilon = inf
DEFAULTS: dict[str, dict[str, Any]] = {}  # a recipe's own Hyperparameters defaults (tuned: docs/defaults.md)


def register(name: str, noise: str = "gaussian", decayed: bool = False, private: bool = True,
             defaults: dict[str, Any] | None = None, sampling: str | None = None) -> Callable[[Recipe], Recipe]:
    """Add recipe ``name``: its default noise mechanism, the sampling that goes with it (None: Poisson for
    iid noise, fixed order for correlated noise), and ``defaults`` for the Hyperparameters fields whose global
    default does not suit it (applied where the user gives no value; an lr may be a ``StepRule``)."""
    unknown = set(defaults or {}) - {f.name for f in fields(Hyperparameters)}
    if unknown:
        raise ValueError(f"{name}: defaults for unknown hyper-parameters {', '.join(sorted(unknown))}")

    def add(recipe: Recipe) -> Recipe:
        ALGORITHMS[name] = recipe
        DEFAULTS[name] = dict(defaults or {})
        DEFAULT_NOISE[name] = noise
        if sampling is not None:
            DEFAULT_SAMPLING[name] = sampling
        if decayed:
            DECAYED_WORKLOAD.add(name)
        if not private:
            NON_PRIVATE.add(name)
        return recipe

    return add


def build_algorithm(name: str, engine: PerExampleEngine, privatizer: Privatizer,
                    hp: Hyperparameters, physical_batch_size: int | None = None) -> DPOptimizer:
    """The recipe ``name``; its steps go through the engine ``physical_batch_size`` examples at a time."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(sorted(ALGORITHMS))}")
    if rules := hp.rules():
        raise ValueError(f"{name}: {', '.join(f'{k} is still the rule {v}' for k, v in rules.items())}; "
                         "resolve it with hp.for_run(steps)")
    optimizer = ALGORITHMS[name](engine, privatizer, hp)
    optimizer.physical_batch_size = physical_batch_size
    return optimizer
