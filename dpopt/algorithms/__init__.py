"""The named recipes. Importing this package registers all of them."""

from dpopt.algorithms import correlated, disk, first_order, grape, zeroth_order  # noqa: F401  (registers the recipes)
from dpopt.algorithms.base import PrivateStep, Privatizer, StepResult, Transform
from dpopt.algorithms.hyperparameters import (SGD, SRG, SRGD, Adam, DiSKAdam, DiSKProjection, DiSKSGD, Hyperparameters,
                                              Projection, StepRule, ZerothOrder)
from dpopt.algorithms.registry import (ALGORITHMS, CONFIGS, DEFAULT_NOISE, DEFAULT_SAMPLING, DEFAULT_TREE_DECODER,
                                       DEFAULTS, NON_PRIVATE, applies_to, build_algorithm, check_algorithm,
                                       hyperparameters_for, register, settings_of)
from dpopt.names import renamed_attributes

__all__ = ["ALGORITHMS", "CONFIGS", "DEFAULT_NOISE", "DEFAULT_SAMPLING", "DEFAULT_TREE_DECODER", "DEFAULTS",
           "NON_PRIVATE", "SGD", "SRG", "SRGD", "Adam", "PrivateStep", "DiSKAdam", "DiSKProjection", "DiSKSGD",
           "Hyperparameters", "Privatizer", "Projection", "StepResult", "StepRule", "Transform", "ZerothOrder",
           "applies_to", "build_algorithm", "check_algorithm", "hyperparameters_for", "register", "settings_of"]

__getattr__ = renamed_attributes(__name__, DPOptimizer="PrivateStep")
