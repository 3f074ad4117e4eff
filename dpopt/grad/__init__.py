"""Per-example statistics: hook rules, ghost/book-keeping captures and the torch.func fallback."""

from dpopt.grad.captures import Capture, Dense, Outer, sq_norms
from dpopt.grad.batch import Closure, LossFn, batch_size_of
from dpopt.grad.engine import PerExampleEngine
from dpopt.grad.gradients import PerExampleGradients
from dpopt.grad.verify import ExampleMixingError, check_per_example
from dpopt.grad.rules import register_rule

__all__ = ["Capture", "Closure", "Dense", "ExampleMixingError", "LossFn", "Outer", "PerExampleEngine",
           "PerExampleGradients", "batch_size_of", "check_per_example", "register_rule", "sq_norms"]
