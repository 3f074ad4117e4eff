"""What a run folder shows a person: ``train.log``, ``curves.png`` and TensorBoard events. Plotting needs
matplotlib and the events need tensorboard; without them the run says so in its log and goes on."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any, Callable

from dpopt.checkpoint import write_atomic

LOG, CURVES, TENSORBOARD = "train.log", "curves.png", "tensorboard"


def logging_to(path: Path, log: Callable[[str], None]) -> Callable[[str], None]:
    """``log`` that also appends every line, time-stamped, to ``path``."""

    def both(line: str) -> None:
        log(line)
        with open(path, "a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")

    return both


def chance_warning(accuracy: float, classes: int, noise_to_signal: str, ratio: float, clipped: float,
                   noise_fix: str, clip_fix: str, margin: float = 0.02) -> str | None:
    """A warning, with its likely cause, for a final test ``accuracy`` within ``margin`` of chance (1 / classes);
    None otherwise. The causes come from the run: ``ratio``, the norm of the noise over the largest norm of the
    signal (``noise_to_signal`` names the formula), and ``clipped``, the fraction of the last updates clipped."""
    if accuracy > 1 / classes + margin:
        return None
    if ratio > 10:
        cause = f"the noise is {ratio:.3g} times the signal ({noise_to_signal}): {noise_fix}"
    elif clipped > 0.99:
        cause = f"every update was clipped ({clipped:.0%} in the last evaluation's span): {clip_fix}"
    else:
        cause = "the learning rate --lr is likely too large or too small for this algorithm"
    return (f"test accuracy {accuracy:.4f} is at chance (1/{classes}): likely cause: {cause}. "
            f"Noise-to-signal ratio {ratio:.3g}; {clipped:.0%} of the updates were clipped.")


def plot_curves(history: list[dict[str, Any]], path: Path) -> Path | None:
    """Training loss and test accuracy at each evaluation, against steps and against the epsilon spent, in one
    PNG; None (nothing written) without matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 6), layout="constrained")
    axes = fig.subplots(2, 2, sharex="col")
    for row, (key, label) in enumerate([("train_loss", "training loss"), ("test_accuracy", "test accuracy")]):
        for col, (x, xlabel) in enumerate([("step", "steps"), ("epsilon", "epsilon spent")]):
            ax = axes[row, col]
            ax.plot([h[x] for h in history], [h[key] for h in history], marker="o")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            if row == 1:
                ax.set_xlabel(xlabel)
    return write_atomic(path, FigureCanvasAgg(fig).print_png)


def tensorboard_writer(folder: Path, purge_step: int | None = None) -> Any | None:
    """A ``torch.utils.tensorboard.SummaryWriter`` writing to ``folder``, or None without tensorboard. A resumed
    run passes its first new step as ``purge_step``: TensorBoard then hides the events an interrupted run wrote
    from that step on, which the resumed run writes again."""
    if importlib.util.find_spec("tensorboard") is None:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(folder), purge_step=purge_step)
