"""Modules imported on first use: dp-accounting (and the scipy it loads) costs seconds to import, and only
epsilon needs it, so ``import dpopt``, the CLI's help and child processes that never account do not pay for it."""

from __future__ import annotations

import importlib
import types
from typing import Any


class LazyModule(types.ModuleType):
    """A stand-in for the module ``name`` that imports it when one of its attributes is first read.

    :param name: the module's dotted name, e.g. ``"dp_accounting.rdp"``
    """

    def __getattr__(self, attribute: str) -> Any:
        """The real module's ``attribute``, importing the module on first use (later reads find it in
        ``sys.modules``).

        :param attribute: the attribute's name
        :returns: the attribute of the imported module
        :raises AttributeError: where the module has no such attribute
        :raises ModuleNotFoundError: where the module is not installed
        """
        return getattr(importlib.import_module(self.__name__), attribute)
