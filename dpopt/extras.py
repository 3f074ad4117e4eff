"""Optional dependencies (pyproject's extras): import one, or fail with one line naming the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message says what to pip install."""


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """``import module``, or a :class:`MissingExtra` saying that ``purpose`` needs ``pip install 'dpopt[extra]'``."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtra(f"{purpose} needs the {module} package: pip install 'dpopt[{extra}]'") from e
