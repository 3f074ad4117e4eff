"""The user pages read as documentation, not as a lab notebook: every page of the site's nav outside the
Reproductions section, and the README, names no date, no issue number, no local path and no paper line number
(a reader has neither the issue tracker's numbering nor the spec files; a paper is cited by its section, algorithm
or equation). The Reproductions pages keep their dated measurements (a GPU lease on a date is evidence), but not
issue numbers. The pages are read as files, without building the site."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
REPRODUCTIONS = "Reproductions"

ISO_DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
ISSUE_NUMBER = re.compile(r"\bissues?\s+#?\d+|(?<![\w/])#\d+\b", re.IGNORECASE)
LOCAL_PATH = re.compile(r"\.\./shared|/work/|/tmp/|\bspecs/")
PAPER_LINE = re.compile(r"(?<![\w-])L\d{2,}\b")  # "L744", "L738-753"; not "L2" (the norm) nor "MiniLM-L6"
USER_PAGE_RULES = {"a date": ISO_DATE, "an issue number": ISSUE_NUMBER, "a local path": LOCAL_PATH,
                   "a paper line number": PAPER_LINE}


class _NavLoader(yaml.SafeLoader):
    """mkdocs.yml with its ``!!python/...`` tags read as nothing (only the nav matters here)."""


_NavLoader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)


def _pages(entries: list[Any], section: str = "") -> list[tuple[str, str]]:
    """(top-level section, page path) for every page of a nav list."""
    found = []
    for entry in entries:
        if isinstance(entry, str):
            found.append((section, entry))
            continue
        for title, value in entry.items():
            if isinstance(value, list):
                found += _pages(value, section or title)
            else:
                found.append((section or title, value))
    return found


def nav_pages() -> list[tuple[str, str]]:
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_NavLoader)
    return _pages(config["nav"])


def user_pages() -> list[Path]:
    pages = [DOCS / page for section, page in nav_pages() if section != REPRODUCTIONS]
    return [ROOT / "README.md"] + [p for p in pages if p.is_file()]  # reference/cli.md, recipes.md: generated


def reproduction_pages() -> list[Path]:
    return [DOCS / page for section, page in nav_pages() if section == REPRODUCTIONS]


def offences(text: str, rules: dict[str, re.Pattern[str]]) -> list[str]:
    """Each line of ``text`` that breaks a rule, as 'line N, <rule>: <the match>'."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for rule, pattern in rules.items():
            found += [f"line {number}, {rule}: {m.group(0)!r}" for m in pattern.finditer(line)]
    return found


def test_the_nav_has_user_pages_and_reproductions():
    sections = {section for section, _ in nav_pages()}
    assert {"Guides", "Methods", "Reference", REPRODUCTIONS} <= sections
    assert len(user_pages()) > 10 and all(p.is_file() for p in reproduction_pages())
    assert DOCS / "results.md" in reproduction_pages() and DOCS / "core.md" in user_pages()


@pytest.mark.parametrize("page", user_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_user_page_has_no_date_issue_number_local_path_or_paper_line(page: Path):
    found = offences(page.read_text(), USER_PAGE_RULES)
    assert not found, f"{page.relative_to(ROOT)}: move it to a Reproductions page or CHANGELOG.md:\n" + "\n".join(found)


@pytest.mark.parametrize("page", reproduction_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_reproduction_page_names_no_issue_number(page: Path):
    found = offences(page.read_text(), {"an issue number": ISSUE_NUMBER})
    assert not found, f"{page.relative_to(ROOT)}:\n" + "\n".join(found)


def test_the_rules_catch_what_they_are_for():
    caught = offences("measured 2026-11-28 (issue 20); was 3 before issue #31, see ../shared/specs/disk.md L744-753;"
                      " /tmp/run and /work/x", USER_PAGE_RULES)
    assert [c.split(":")[0] for c in caught] == ["line 1, a date", "line 1, an issue number",
                                                  "line 1, an issue number", "line 1, a local path",
                                                  "line 1, a local path", "line 1, a local path",
                                                  "line 1, a local path", "line 1, a paper line number"]
    assert not offences("the L2 norm of all-MiniLM-L6-v2's gradient; Alg. 1, eq. (3); 1e-6; v0.3.0; see #anchor",
                        USER_PAGE_RULES)
