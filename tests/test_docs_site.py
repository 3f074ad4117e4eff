"""The docs site as a reader sees it (issue 48): `mkdocs build --strict` passes (a warning fails it: a broken link
or anchor, a page left out of the nav, a public name with no reference entry), no internal link of the built site
is broken, the generated reference pages cover the CLI, the recipes and the run-folder formats, and, where
Chromium is installed, three pages render in a headless browser. The site is built once for the module."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers")),
    reason="the docs site needs the [docs] extra (mkdocs, mkdocs-material, mkdocstrings[python]): "
           "pip install -e '.[docs]', or make docs")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("docs") / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    log = done.stdout + done.stderr
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{log[-4000:]}"
    assert "WARNING" not in log, log
    return out


def test_the_strict_build_writes_every_section(site: Path) -> None:
    for page in ("index.html", "own_loop/index.html", "core/index.html", "design/index.html", "errors/index.html",
                 "results/index.html", "reference/api/index.html", "reference/cli/index.html",
                 "reference/recipes/index.html", "reference/formats/index.html"):
        assert (site / page).is_file(), page


def test_no_internal_link_of_the_built_site_is_broken(site: Path) -> None:
    from docs_check import check_links

    checked, broken = check_links(site)
    assert checked > 500  # the nav alone links every page from every page
    assert broken == []


def test_the_link_check_finds_a_broken_link_and_anchor(tmp_path: Path) -> None:
    from docs_check import check_links

    (tmp_path / "a").mkdir()
    (tmp_path / "index.html").write_text('<a href="a/">ok</a><a href="a/#here">ok</a><a href="b/">gone</a>'
                                         '<a href="a/#nowhere">no anchor</a><a href="https://example.org/x">ext</a>')
    (tmp_path / "a" / "index.html").write_text('<h2 id="here">x</h2><img src="../missing.png">')
    checked, broken = check_links(tmp_path)
    assert checked == 5
    assert len(broken) == 3 and any("b/" in b for b in broken) and any("nowhere" in b for b in broken)
    assert any("missing.png" in b for b in broken)


def test_the_cli_reference_is_generated_from_the_parser(site: Path) -> None:
    from dpopt import cli

    page = (site / "reference" / "cli" / "index.html").read_text()
    commands = next(a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(commands) >= {"train", "federated", "audit", "account", "calibrate", "bench", "reproduce"}
    for name, sub in commands.items():
        assert f"dpopt {name}" in page
        for action in sub._actions:
            if action.help == argparse.SUPPRESS:  # hidden from --help (an old flag's name), so from the page too
                continue
            for option in action.option_strings:
                assert option in page, (name, option)


def test_the_recipes_page_lists_every_recipe(site: Path) -> None:
    import dpopt

    page = (site / "reference" / "recipes" / "index.html").read_text()
    for name in dpopt.ALGORITHMS:
        assert f"<code>{name}</code>" in page, name


def test_every_public_name_is_documented(site: Path, tmp_path: Path) -> None:
    import dpopt
    from docs_hooks import check_public_names

    page = (site / "reference" / "api" / "index.html").read_text()
    for name in dpopt.__all__:
        if name not in ("ALGORITHMS", "__version__"):
            assert f'id="dpopt.{name}"' in page or f'id="dpopt.hf.{name}"' in page, name
    assert check_public_names(ROOT / "docs") == []
    # A name left out of the API page is reported (the strict build then fails on it).
    shutil.copytree(ROOT / "docs" / "reference", tmp_path / "reference")
    api = tmp_path / "reference" / "api.md"
    api.write_text(api.read_text().replace("::: dpopt.SRGD\n", ""))
    assert check_public_names(tmp_path) == ["public name dpopt.SRGD is on no reference page (add '::: dpopt.SRGD' "
                                            "to docs/reference/api.md)"]


def _dict_keys(source: Path, function: str) -> set[str]:
    """The string keys of the dict literals ``function`` returns or assigns, and of its ``name["key"] = ...``."""
    tree = ast.parse(source.read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    keys: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, (ast.Return, ast.Assign)) and isinstance(node.value, ast.Dict):
            keys |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript):
            key = node.targets[0].slice
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                keys.add(key.value)
    return keys


def _documented_keys(page: str, heading: str) -> set[str]:
    section = page.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([\w/.]+)` \|", section, re.MULTILINE))


def test_the_formats_page_matches_the_code() -> None:
    from dpopt.cli import RUN_FILES

    page = (ROOT / "docs" / "reference" / "formats.md").read_text()
    assert _documented_keys(page, "`checkpoint.pt`") == _dict_keys(ROOT / "dpopt" / "run" / "state.py",
                                                                     "checkpoint_state")
    metrics = _dict_keys(ROOT / "dpopt" / "run" / "outputs.py", "metrics_of")
    metrics |= {"warning"}  # added by the loop where the final accuracy is at chance (dpopt/run/loop.py)
    assert 'metrics["warning"]' in (ROOT / "dpopt" / "run" / "loop.py").read_text()
    assert _documented_keys(page, "`metrics.json`") == metrics
    files = {f.rstrip("/") for f in _documented_keys(page, "The run folder")}
    assert files == set(RUN_FILES)


@pytest.mark.skipif(shutil.which("chromium") is None and shutil.which("chromium-browser") is None,
                    reason="no headless browser: apt-get install chromium (make docs-browser)")
def test_pages_render_in_a_headless_browser(site: Path) -> None:
    from docs_check import _Rendered, check_browser

    failures, shots = check_browser(site)
    assert failures == []
    assert [s.name for s in shots] == ["home.png", "own_loop.png", "reference_api.png"]
    # The copy buttons the check looks for are added by the page's scripts: the static HTML has none.
    static = _Rendered()
    static.feed((site / "index.html").read_text())
    assert static.code_blocks > 0 and static.copy_buttons == 0
