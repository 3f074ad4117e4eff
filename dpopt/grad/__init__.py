"""Per-example statistics: hook rules, ghost/book-keeping captures and the torch.func fallback."""

from dpopt.grad.captures import Capture, Dense, Outer, sq_norms
from dpopt.grad.engine import (ExampleMixingError, PerExampleEngine, PerExampleGradients, batch_size_of,
                               check_per_example)
from dpopt.grad.rules import register_rule

__all__ = ["Capture", "Dense", "ExampleMixingError", "Outer", "PerExampleEngine", "PerExampleGradients",
           "batch_size_of", "check_per_example", "register_rule", "sq_norms"]
