"""MkDocs hooks of the docs site (mkdocs.yml: ``hooks``).

* ``reference/cli.md`` is written from ``dpopt.cli.parser()``: the ``--help`` of ``dpopt`` and of each subcommand,
  so the page cannot drift from the parser.
* ``reference/recipes.md`` is written from the registry behind ``dpopt.ALGORITHMS``: each recipe's name, its typed
  config and its tuned defaults.
* Every public name (``dpopt.__all__``) must be documented: rendered on a reference page by a ``::: `` directive
  (or by the generated recipes page), with a docstring. A name that is not is a warning, and the strict build
  fails on it.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.plugins.dpopt_docs")

ROOT = Path(__file__).resolve().parent.parent
HELP_COLUMNS = "100"  # the width the --help text is wrapped at, whatever the terminal of the build
# Public names rendered by something other than a ``:::`` directive, and where.
ELSEWHERE = {"ALGORITHMS": "reference/recipes.md (generated)", "__version__": "reference/api.md (prose)"}


@contextlib.contextmanager
def _columns(width: str) -> Iterator[None]:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = width
    try:
        yield
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return {name: sub for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for name, sub in action.choices.items()}


def cli_page() -> str:
    from dpopt import cli

    top = cli.parser()
    lines = ["# Command line reference", "",
             "Generated from `dpopt.cli.parser()` when the site is built: each block is the command's `--help`. "
             "The [command line guide](../cli.md) shows them at work.", ""]
    with _columns(HELP_COLUMNS):
        lines += ["## `dpopt`", "", "```text", top.format_help().rstrip(), "```", ""]

        def walk(parser: argparse.ArgumentParser, prefix: str, level: int) -> None:
            for name, sub in _subcommands(parser).items():
                lines.extend([f"{'#' * level} `{prefix} {name}`", "", "```text", sub.format_help().rstrip(), "```",
                              ""])
                walk(sub, f"{prefix} {name}", level + 1)

        walk(top, "dpopt", 2)
    return "\n".join(lines)


def _value(v: Any) -> str:
    return f"`{v}`" if not isinstance(v, str) else f"`{v!r}`"


def recipes_page() -> str:
    from dpopt.algorithms import registry

    lines = ["# Recipes (`dpopt.ALGORITHMS`)", "",
             "Generated from the registry when the site is built. `dpopt.ALGORITHMS` maps each recipe's name to the "
             "function that builds it; the name goes to `make_private(..., algorithm=)`, "
             "`PrivacyArguments(algorithm=)` and `dpopt train --algorithm`. Its settings are the fields of its "
             "family's config ([`hyperparameters_for(name)`](api.md#dpopt.hyperparameters_for)), with the recipe's "
             "tuned defaults on top of the family's.", "",
             "| recipe | config | private | tuned defaults (over the config's) |", "|---|---|---|---|"]
    for name in registry.ALGORITHMS:
        config = registry.CONFIGS[name].__name__
        defaults = ", ".join(f"`{k}` = {_value(v)}" for k, v in registry.DEFAULTS[name].items()) or "none"
        private = "no (a baseline: epsilon = inf)" if name in registry.NON_PRIVATE else "yes"
        lines.append(f"| `{name}` | [`{config}`](api.md#dpopt.{config}) | {private} | {defaults} |")
    lines += ["", "Each config's fields and their defaults:", ""]
    seen: set[str] = set()
    for name in registry.ALGORITHMS:
        config = registry.CONFIGS[name]
        if config.__name__ in seen:
            continue
        seen.add(config.__name__)
        lines += [f"## `{config.__name__}`", "", "| field | default | meaning |", "|---|---|---|"]
        for f in dataclasses.fields(config):
            default = f.default if f.default is not dataclasses.MISSING else "(required)"
            lines.append(f"| `{f.name}` | {_value(default)} | {f.metadata.get('help', '')} |")
        lines.append("")
    return "\n".join(lines)


def _public_names() -> list[str]:
    tree = ast.parse((ROOT / "dpopt" / "__init__.py").read_text())
    names: list[str] = []
    hf: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id == "_HF":
                hf = [e.value for e in node.value.elts]  # type: ignore[attr-defined]
            elif node.targets[0].id == "__all__":
                for e in node.value.elts:  # type: ignore[attr-defined]
                    if isinstance(e, ast.Starred):
                        names += hf
                    else:
                        names.append(e.value)
    return names


DIRECTIVE = re.compile(r"^:::\s+([\w.]+)", re.MULTILINE)


def check_public_names(docs_dir: Path) -> list[str]:
    """The public names the reference leaves undocumented (no directive, or no docstring), as messages."""
    import griffe

    rendered = {ident.rsplit(".", 1)[-1]: ident for page in (docs_dir / "reference").glob("*.md")
                for ident in DIRECTIVE.findall(page.read_text())}
    package = griffe.load("dpopt", search_paths=[str(ROOT)], resolve_aliases=False)
    problems = []
    for name in _public_names():
        if name in ELSEWHERE:
            continue
        if name not in rendered:
            problems.append(f"public name dpopt.{name} is on no reference page (add '::: dpopt.{name}' to "
                            f"docs/reference/api.md)")
            continue
        obj = package[rendered[name].removeprefix("dpopt.")]
        while obj.is_alias:
            obj = obj.final_target
        if not (obj.docstring and obj.docstring.value.strip()):
            problems.append(f"public name dpopt.{name} ({rendered[name]}) has no docstring")
    return problems


def on_files(files: Files, config: Any) -> Files:
    for problem in check_public_names(Path(config["docs_dir"])):
        log.warning(problem)
    files.append(File.generated(config, "reference/cli.md", content=cli_page()))
    files.append(File.generated(config, "reference/recipes.md", content=recipes_page()))
    return files
