"""Learning-rate schedules: the factor the base update's learning rate is multiplied by at each step.

A linear warm-up over the first ``warmup`` steps (a fraction of the run if below 1, else a number of steps), then
``constant``, ``cosine`` (annealed to 0 at the run's end, as DiSK's paper trains) or ``linear`` (decayed to 0).
The factor is a function of the step and the run's length alone, so a resumed run follows the same schedule; a
schedule is post-processing of the releases and changes no privacy guarantee.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

SCHEDULES = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class Schedule:
    kind: str = "constant"
    warmup: float = 0.0  # a fraction of the run's steps if below 1, else a number of steps

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"unknown learning-rate schedule {self.kind!r}; choose one of {', '.join(SCHEDULES)}")
        if not (math.isfinite(self.warmup) and self.warmup >= 0):
            raise ValueError(f"the warm-up must be a fraction of the run in [0, 1) or a number of steps >= 1, "
                             f"got {self.warmup}")

    @property
    def is_constant(self) -> bool:
        return self.kind == "constant" and self.warmup == 0

    def warmup_steps(self, steps: int) -> int:
        """The warm-up's length over a run of ``steps`` steps; it must leave at least one step after it."""
        w = round(self.warmup * steps) if self.warmup < 1 else int(self.warmup)
        if w >= steps:
            raise ValueError(f"the warm-up ({w} steps) must be shorter than the run ({steps} steps)")
        return w

    def for_run(self, steps: int) -> Callable[[int], float] | None:
        """The factor at each step of a run of ``steps`` steps (``PrivateStep.schedule``), or None for a constant
        rate; a warm-up as long as the run is refused here, before training."""
        if self.is_constant:
            return None
        self.warmup_steps(steps)
        return functools.partial(self.factor, steps=steps)

    def factor(self, step: int, steps: int) -> float:
        """The learning rate's factor at ``step`` (0-based) of a run of ``steps`` steps."""
        w = self.warmup_steps(steps)
        if step < w:
            return (step + 1) / (w + 1)
        progress = (step - w) / (steps - w)
        if self.kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0 - progress if self.kind == "linear" else 1.0
