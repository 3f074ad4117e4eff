"""dpopt as an installed library: one version, torch as a floor (pinned only for this machine), and a command that
needs the checkout says so. The built wheel itself is checked in a fresh venv by .ci/wheel_smoke.sh (make wheel-smoke)."""

import importlib.metadata
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import dpopt
from dpopt import cli

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_one_version_in_pyproject():
    assert dpopt.__version__ == PROJECT["version"] == importlib.metadata.version("dpopt")


def test_torch_is_a_floor_and_the_local_wheel_a_constraint():
    torch = next(Requirement(r) for r in PROJECT["dependencies"] if Requirement(r).name == "torch")
    assert torch.specifier.contains("2.11.0") and torch.specifier.contains("2.99.0"), torch  # never replaces a newer one
    pins = [line for line in (ROOT / "constraints.txt").read_text().splitlines() if line.startswith("torch==")]
    assert len(pins) == 1 and torch.specifier.contains(pins[0].removeprefix("torch==")), pins


def test_reproduce_outside_a_checkout_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_experiments_dir", lambda: tmp_path / "site-packages" / "experiments")
    for argv in (["reproduce"], ["reproduce", "crash_safety"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and "needs a source checkout" in err[0], err
