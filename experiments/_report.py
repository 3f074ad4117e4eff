"""Writing a measurement's results: the raw numbers as JSON and its markdown table, printed too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_table(out: str | Path, name: str, results: Any, lines: list[str]) -> None:
    """``NAME.json`` (``results``) and ``NAME.md`` (the table's ``lines``) under ``out``; prints the table."""
    table = "\n".join(lines) + "\n"
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / f"{name}.md").write_text(table)
    print(table, end="")
