"""The named recipes. Importing this package registers all of them."""

from dpopt.algorithms import correlated, disk, first_order, grape, zeroth_order  # noqa: F401  (registers the recipes)
from dpopt.algorithms.base import DPOptimizer, Privatizer, StepResult, Transform
from dpopt.algorithms.registry import (ALGORITHMS, DECAYED_WORKLOAD, DEFAULT_NOISE, DEFAULT_SAMPLING, DEFAULTS,
                                       NON_PRIVATE, Hyperparameters, StepRule, build_algorithm, register)

__all__ = ["ALGORITHMS", "DECAYED_WORKLOAD", "DEFAULT_NOISE", "DEFAULT_SAMPLING", "DEFAULTS", "NON_PRIVATE",
           "DPOptimizer", "Hyperparameters", "Privatizer", "StepResult", "StepRule", "Transform", "build_algorithm",
           "register"]
