import dataclasses
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

CURVES_MARK = "curves"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{CURVES_MARK}: the test's runs draw curves.png with matplotlib (the others "
                                       "check the history the plot reads and draw nothing: half a second of CPU a run)")


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        yield


def history_plotted(history: list[dict[str, Any]], path: Path) -> Path:
    """``dpopt.report.plot_curves`` without the drawing: each evaluation holds the numbers the plot reads."""
    for evaluation in history:
        for key in ("step", "epsilon", "train_loss", "test_accuracy"):
            float(evaluation[key])
    return path


@pytest.fixture(autouse=True)
def _curves_only_where_checked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process runs skip drawing ``curves.png`` unless the test is marked ``curves`` (runs in child processes,
    the console script's among them, still draw it)."""
    if request.node.get_closest_marker(CURVES_MARK) is None:
        monkeypatch.setattr("dpopt.run.loop.plot_curves", history_plotted)


@pytest.fixture
def float64_digits(monkeypatch):
    """dpopt train's runs on digits in float64 (model and data), where sums taken in another order or another code
    path agree to 1e-9."""
    from dpopt.run import build

    load = build.load_dataset

    def load_float64(*args):
        data = load(*args)
        return dataclasses.replace(data, train=(data.train[0].double(), data.train[1]),
                                   test=(data.test[0].double(), data.test[1]))

    monkeypatch.setattr(build, "load_dataset", load_float64)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(default)
