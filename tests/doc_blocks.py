"""The Python code blocks of a Markdown page, as the docs tests run them: every ```python block, in order, in one
namespace, each compiled under the page's name and its own line numbers (a traceback points at the page). A block
that cannot run in the tests is marked by an HTML comment on the line before its fence, which states the reason:
``<!-- no-run: needs a GPU -->``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BLOCK = re.compile(r"^(?:<!--\s*no-run:(?P<reason>[^\n]*?)-->\n)?```python\n(?P<code>.*?)^```", re.M | re.S)


@dataclass(frozen=True)
class Block:
    """One ```python block: its page, the line of its first code line, its code, and why it does not run (None:
    it runs)."""

    page: str
    line: int
    code: str
    no_run: str | None


def python_blocks(path: Path, name: str | None = None) -> list[Block]:
    """The ```python blocks of the Markdown file ``path``, named ``name`` (default: the file's name)."""
    return blocks_in(path.read_text(), name or path.name)


def blocks_in(text: str, name: str) -> list[Block]:
    """The ```python blocks of Markdown ``text`` (a page, a docstring), named ``name``."""
    found = []
    for match in BLOCK.finditer(text):
        reason = match.group("reason")
        line = text.count("\n", 0, match.start("code")) + 1
        found.append(Block(name, line, match.group("code"),
                           None if reason is None else reason.strip()))
    return found


def run_block(block: Block, namespace: dict[str, Any]) -> None:
    """Execute ``block`` in ``namespace``; its lines keep their numbers on the page."""
    code = compile("\n" * (block.line - 1) + block.code, block.page, "exec")
    exec(code, namespace)  # noqa: S102 (the project's own documentation)
