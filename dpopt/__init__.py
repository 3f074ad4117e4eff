"""dpopt: differentially private training for PyTorch. ``make_private`` is the one-call entry for a plain loop."""

from dpopt.loop import make_private

__all__ = ["make_private"]
