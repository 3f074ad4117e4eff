"""dpopt: differentially private training for PyTorch.

What users call: ``make_private`` (a plain loop; it returns a ``PrivateOptimizer``), ``PrivateTrainer`` with
``PrivacyArguments`` (Hugging Face; imported on first use), ``PrivacyPlan`` (sampling, clipping, noise and
accounting of a run), ``PrivacyLedger`` (its epsilon and ``dp_accounting`` event), ``ALGORITHMS`` (the recipes,
chosen by ``algorithm=``) and their hyper-parameters (``hyperparameters_for``, one typed config per family).
"""

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from dpopt.algorithms import (ALGORITHMS, SGD, SRG, SRGD, Adam, DiSKAdam, DiSKProjection, DiSKSGD, Hyperparameters,
                              Projection, StepRule, ZerothOrder, hyperparameters_for)
from dpopt.loop import PrivateOptimizer, make_private
from dpopt.plan import PrivacyPlan
from dpopt.privacy import PrivacyLedger

try:
    __version__ = version("dpopt")
except PackageNotFoundError:  # a source tree that was not installed
    __version__ = "0+unknown"

_HF = ("PrivateTrainer", "PrivacyArguments")  # need transformers: imported on first use

__all__ = ["ALGORITHMS", "SGD", "SRG", "SRGD", "Adam", "DiSKAdam", "DiSKProjection", "DiSKSGD", "Hyperparameters",
           "PrivacyLedger", "PrivacyPlan", "PrivateOptimizer", "Projection", "StepRule", "ZerothOrder", "__version__",
           "hyperparameters_for", "make_private", *_HF]


def __getattr__(name: str) -> Any:
    if name in _HF:
        from dpopt import hf
        return getattr(hf, name)
    raise AttributeError(f"module 'dpopt' has no attribute {name!r}")
