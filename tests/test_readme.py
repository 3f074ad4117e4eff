"""Every Python block of the README runs, in order, in one namespace (the Trainer's on a tiny BERT)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), re.M | re.S)


def test_the_readme_is_short_and_its_python_blocks_run(tmp_path, monkeypatch):
    assert len(README.read_text().splitlines()) <= 150
    blocks = python_blocks()
    assert len(blocks) == 3
    monkeypatch.chdir(tmp_path)  # the Trainer writes its output folder here
    namespace: dict = {}
    exec(compile(blocks[0], "README quick start", "exec"), namespace)  # noqa: S102
    assert 0 < namespace["optimizer"].epsilon() <= 2.0 and "epsilon" in namespace["optimizer"].statement()
    exec(compile(blocks[1], "README recipe", "exec"), namespace)  # noqa: S102
    assert namespace["optimizer"].dp.steps >= 1

    pytest.importorskip("transformers")
    from test_hf_trainer import as_list, examples, tiny_bert
    namespace.update(model=tiny_bert(), train=as_list(examples()) * 22)  # 528 examples: one logical batch of 512
    exec(compile(blocks[2], "README Trainer", "exec"), namespace)  # noqa: S102
    assert namespace["trainer"].epsilon() <= 3.0
