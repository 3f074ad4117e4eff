"""Every example in the docstrings of the public names (``dpopt.__all__``, and the parts of a step that the API
reference renders) runs.

An example is a fenced ```` ```python ```` block of a docstring: the public object's own, or one of its public
methods' and properties'. The blocks of one docstring run in order, in one namespace, in a temporary folder; their
``assert`` lines check what they show. The few that cannot run here are listed in ``NOT_RUN`` with the reason,
and the test checks that the list matches the docstrings.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import pytest
import torch

import dpopt
from doc_blocks import blocks_in, run_block

HF_NAMES = ("PrivateTrainer", "PrivacyArguments")  # need transformers (the hf extra)
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
API_PAGE = Path(__file__).parents[1] / "docs" / "reference" / "api.md"
DIRECTIVE = re.compile(r"^:::\s+([\w.]+)", re.M)
# Docstrings whose examples are shown, not run: "dpopt.Name" or "dpopt.Name.method" -> the reason.
NOT_RUN: dict[str, str] = {}
# The names whose docstring must show an example (the ones a user starts from).
MUST_SHOW = {"dpopt.make_private", "dpopt.PrivateTrainer", "dpopt.PrivacyArguments", "dpopt.hyperparameters_for",
             "dpopt.PrivacyPlan", "dpopt.PrivacyLedger", "dpopt.StepRule", "dpopt.Hyperparameters",
             "dpopt.algorithms.base.Privatizer"}


def _members(cls: type) -> dict[str, object]:
    """The functions a class defines itself (methods, properties' getters, class and static methods)."""
    found = {}
    for member, value in vars(cls).items():
        if member.startswith("_") and member != "__call__":
            continue
        if isinstance(value, property):
            value = value.fget
        elif isinstance(value, (classmethod, staticmethod)):
            value = value.__func__
        if inspect.isfunction(value):
            found[member] = value
    return found


def _resolve(path: str) -> object:
    """The object at a dotted path: its longest importable module prefix, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def _public_objects() -> dict[str, object]:
    """``dpopt.__all__`` and whatever else the API reference renders (the parts of a step), by dotted name."""
    found = {f"dpopt.{name}": getattr(dpopt, name) for name in dpopt.__all__
             if HAS_TRANSFORMERS or name not in HF_NAMES}
    seen = {id(obj) for obj in found.values()}
    for path in DIRECTIVE.findall(API_PAGE.read_text()):
        if path.startswith("dpopt.hf.") and not HAS_TRANSFORMERS:
            continue
        obj = _resolve(path)
        if id(obj) not in seen:
            found[path] = obj
            seen.add(id(obj))
    return found


def _docstrings() -> dict[str, str]:
    """Each public object's docstring and its public members' (those its class defines), by dotted name."""
    found: dict[str, str] = {}
    for name, obj in _public_objects().items():
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue  # ALGORITHMS (a dict) and __version__: documented on the reference pages
        found[name] = inspect.getdoc(obj) or ""
        if inspect.isclass(obj):
            for member, function in _members(obj).items():
                found[f"{name}.{member}"] = inspect.getdoc(function) or ""
    return found


DOCSTRINGS = _docstrings()
EXAMPLES = {name: blocks_in(doc, f"docstring of {name}") for name, doc in DOCSTRINGS.items()}
RUN = sorted(name for name, blocks in EXAMPLES.items() if blocks and name not in NOT_RUN)


def test_the_examples_are_where_users_look_and_not_run_is_accurate() -> None:
    shown = {name for name, blocks in EXAMPLES.items() if blocks}
    must = {name for name in MUST_SHOW if HAS_TRANSFORMERS or name.removeprefix("dpopt.") not in HF_NAMES}
    assert must <= shown, f"no example in {sorted(must - shown)}"
    assert set(NOT_RUN) <= shown, f"NOT_RUN lists docstrings without an example: {sorted(set(NOT_RUN) - shown)}"
    # one form of example: a doctest prompt or an rST literal block would be shown but never run
    other = sorted(name for name, doc in DOCSTRINGS.items() if ">>> " in doc or re.search(r"::\n\n", doc))
    assert not other, f"examples not in a fenced python block: {other}"
    print(f"{len(RUN)} docstrings' examples run, {len(NOT_RUN)} shown only: {NOT_RUN}")


@pytest.mark.parametrize("name", RUN)
def test_the_docstring_example_runs(name: str, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # an example may write (a Trainer's output folder, a checkpoint)
    torch.manual_seed(0)
    namespace: dict = {"__name__": f"docstring of {name}"}
    for block in EXAMPLES[name]:
        run_block(block, namespace)
