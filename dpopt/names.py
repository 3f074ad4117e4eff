"""The names users type: old names of public arguments and flags (a call or command line that uses one gets a
one-line error naming the new one), a setting's flag, and a "did you mean" for a mistyped name."""

from __future__ import annotations

import argparse
import difflib
import functools
from typing import Any, Callable, Sequence, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def renamed(**new_names: str) -> Callable[[F], F]:
    """Refuse the keyword arguments ``old=`` of the decorated function with "``old=`` is now ``new=``"."""

    def wrap(function: F) -> F:
        @functools.wraps(function)
        def call(*args: Any, **kwargs: Any) -> Any:
            for old in kwargs.keys() & new_names.keys():
                raise TypeError(f"{function.__name__}({old}=...) is now {new_names[old]}=")
            return function(*args, **kwargs)

        return call  # type: ignore[return-value]

    return wrap


def flag(name: str) -> str:
    """The command-line flag of a setting: ``tree_decoder`` is ``--tree-decoder``."""
    return "--" + name.replace("_", "-")


def add_renamed_flags(parser: argparse.ArgumentParser, **new_flags: str) -> None:
    """Hidden flags ``--old`` that stop the parse with "--old is now --new" (exit 2)."""
    for old, new in new_flags.items():
        parser.add_argument(flag(old), nargs="?", help=argparse.SUPPRESS,
                            action=_renamed_flag(f"{flag(old)} is now {new}"))


def _renamed_flag(message: str) -> type[argparse.Action]:
    class Renamed(argparse.Action):
        def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
            parser.error(message)

    return Renamed


def renamed_attributes(module: str, **new_names: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` under which an old name (``from module import Old``) fails with "Old is now New"."""

    def attribute(name: str) -> Any:
        if name in new_names:
            raise ImportError(f"{module}.{name} is now {new_names[name]}")
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return attribute


def did_you_mean(name: str, names: Sequence[str]) -> str:
    """"; did you mean 'x'?" for the name in ``names`` closest to a mistyped ``name``, or "": case aside, and
    close enough to take two letters swapped in a short name ('mpl': 'mlp')."""
    lower = {n.lower(): n for n in names}
    close = difflib.get_close_matches(name.lower(), list(lower), n=1, cutoff=0.6)
    return f"; did you mean {lower[close[0]]!r}?" if close else ""
