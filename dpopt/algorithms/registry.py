"""The named recipes: each is a short function that picks the parts of the private step, registered with the
typed config of its family (``hyperparameters``), its noise mechanism and its sampling."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Callable

from dpopt.algorithms.base import PrivateStep, Privatizer
from dpopt.algorithms.hyperparameters import Hyperparameters
from dpopt.grad.engine import PerExampleEngine

Recipe = Callable[[PerExampleEngine, Privatizer, Hyperparameters], PrivateStep]
ALGORITHMS: dict[str, Recipe] = {}
"""The recipes by name (``dp-sgd``, ``dp-adam``, ``disk-adam``, ``dp-grape``, ``dpzero``, ``dp-memf``, ...): the
name goes to ``make_private(..., algorithm=)``, ``PrivacyArguments(algorithm=)`` and ``dpopt train --algorithm``;
each maps to the function that builds its private step. The recipes page of the reference lists them with their
configs and tuned defaults."""
CONFIGS: dict[str, type[Hyperparameters]] = {}  # the typed config of each recipe's family
DEFAULT_NOISE: dict[str, str] = {}  # a recipe's noise mechanism unless --noise says otherwise
DEFAULT_SAMPLING: dict[str, str] = {}  # a recipe's sampling with its own noise, unless --sampling says otherwise
DEFAULT_TREE_DECODER: dict[str, str] = {}  # a recipe's decoder of tree noise, where not the plain sum
NON_PRIVATE: set[str] = set()  # baselines that release without noise: no privacy target, epsilon = inf
DEFAULTS: dict[str, dict[str, Any]] = {}  # a recipe's own hyper-parameter defaults (tuned: docs/defaults.md)


def register(name: str, config: type[Hyperparameters], noise: str = "gaussian", private: bool = True,
             defaults: dict[str, Any] | None = None, sampling: str | None = None,
             tree_decoder: str | None = None) -> Callable[[Recipe], Recipe]:
    """Add recipe ``name`` with the hyper-parameters ``config`` of its family, its default noise mechanism, the
    sampling that goes with it (None: Poisson for iid noise, fixed order for correlated noise), its decoder of
    tree noise, and ``defaults`` for the fields whose family default does not suit it (applied where the user
    gives no value; an lr may be a ``StepRule``)."""
    unknown = set(defaults or {}) - {f.name for f in fields(config)}
    if unknown:
        raise ValueError(f"{name}: defaults for hyper-parameters {config.__name__} lacks: {', '.join(sorted(unknown))}")

    def add(recipe: Recipe) -> Recipe:
        ALGORITHMS[name] = recipe
        CONFIGS[name] = config
        DEFAULTS[name] = dict(defaults or {})
        DEFAULT_NOISE[name] = noise
        if sampling is not None:
            DEFAULT_SAMPLING[name] = sampling
        if tree_decoder is not None:
            DEFAULT_TREE_DECODER[name] = tree_decoder
        if not private:
            NON_PRIVATE.add(name)
        return recipe

    return add


def check_algorithm(name: str) -> None:
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(sorted(ALGORITHMS))}")


def settings_of(name: str) -> set[str]:
    """The names of recipe ``name``'s hyper-parameters (the fields of its family's config)."""
    return {f.name for f in fields(CONFIGS[name])}


def applies_to(setting: str) -> list[str]:
    """The recipes whose hyper-parameters include ``setting``."""
    return sorted(name for name in CONFIGS if setting in settings_of(name))


def hyperparameters_for(name: str, spell: Callable[[str], str] = str, **overrides: Any) -> Hyperparameters:
    """The hyper-parameters of a recipe: its family's config with the recipe's tuned defaults and ``overrides``
    on top. ``hyperparameters_for("dp-grape", rank=8)`` is a ``Projection``.

    ```python
    from dpopt import ALGORITHMS, Projection, hyperparameters_for

    hp = hyperparameters_for("dp-grape", rank=8)
    assert isinstance(hp, Projection) and hp.rank == 8 and hp.subspace_every == 100   # the family's default
    assert hp.for_run(400).lr == 0.15 / 400 ** 0.5          # the recipe's tuned lr, a rule of the run's length
    try:
        hyperparameters_for("dp-sgd", rank=8)                # DP-SGD has no projection
    except ValueError as e:
        error = str(e)
    assert error.startswith("rank does not apply to dp-sgd (it applies to disk-grape, dp-galore, dp-grape)")
    assert "dp-grape" in ALGORITHMS
    ```

    :param name: the recipe (``dpopt.ALGORITHMS``).
    :param spell: how an error writes a setting's name (the CLI: as its flag).
    :param overrides: settings of the recipe's family; those given as None keep the recipe's defaults.
    :returns: the recipe's typed config; an lr may still be a ``StepRule`` of the run's length (``for_run``).
    :raises ValueError: for an unknown recipe, a setting outside its family (naming the recipes it applies to),
        or a value out of range.
    """
    check_algorithm(name)
    given = {k: v for k, v in overrides.items() if v is not None}
    own = settings_of(name)
    for setting in sorted(set(given) - own):
        users = applies_to(setting)
        where = f"it applies to {', '.join(users)}" if users else "no algorithm has it"
        raise ValueError(f"{spell(setting)} does not apply to {name} ({where}); {name} takes "
                         f"{', '.join(spell(f) for f in sorted(own))}")
    return CONFIGS[name](**{**DEFAULTS[name], **given})


def build_algorithm(name: str, engine: PerExampleEngine, privatizer: Privatizer,
                    hp: Hyperparameters, physical_batch_size: int | None = None) -> PrivateStep:
    """The recipe ``name`` with hyper-parameters ``hp`` (of its family: ``hyperparameters_for``); its steps go
    through the engine ``physical_batch_size`` examples at a time.

    :param name: the recipe (``ALGORITHMS``).
    :param engine: the per-example engine of the model and its loss.
    :param privatizer: the clipping, noise, sampler and ledger (``PrivacyPlan.make``).
    :param hp: the recipe's config, its ``StepRule`` fields resolved (``hp.for_run(steps)``).
    :param physical_batch_size: the most examples per forward and backward (None: the whole logical batch).
    :returns: the ``PrivateStep`` whose ``step(batch)`` is one private step.
    :raises ValueError: for an unknown recipe, or a field still given as a ``StepRule``.
    :raises TypeError: for a config of another family.
    """
    check_algorithm(name)
    if not isinstance(hp, CONFIGS[name]):
        raise TypeError(f"{name} takes {CONFIGS[name].__name__} hyper-parameters (hyperparameters_for({name!r}, "
                        f"...)), not {type(hp).__name__}")
    if rules := hp.rules():
        raise ValueError(f"{name}: {', '.join(f'{k} is still the rule {v}' for k, v in rules.items())}; "
                         "resolve it with hp.for_run(steps)")
    optimizer = ALGORITHMS[name](engine, privatizer, hp)
    optimizer.physical_batch_size = physical_batch_size
    return optimizer
