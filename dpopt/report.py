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


def tensorboard_writer(folder: Path) -> Any | None:
    """A ``torch.utils.tensorboard.SummaryWriter`` writing to ``folder``, or None without tensorboard."""
    if importlib.util.find_spec("tensorboard") is None:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(folder))
