"""Every Python block of the README runs, in order, in one namespace (the Trainer's on a tiny BERT)."""

from pathlib import Path

import pytest

from doc_blocks import python_blocks, run_block

README = Path(__file__).parents[1] / "README.md"


def test_the_readme_is_short_and_its_python_blocks_run(tmp_path, monkeypatch):
    assert len(README.read_text().splitlines()) <= 150
    blocks = python_blocks(README)
    assert len(blocks) == 3 and not any(b.no_run for b in blocks)
    monkeypatch.chdir(tmp_path)  # the Trainer writes its output folder here
    namespace: dict = {}
    run_block(blocks[0], namespace)  # the quick start
    assert 0 < namespace["optimizer"].epsilon() <= 2.0 and "epsilon" in namespace["optimizer"].statement()
    run_block(blocks[1], namespace)  # a recipe
    assert namespace["optimizer"].dp.steps >= 1

    pytest.importorskip("transformers")
    from test_hf_trainer import as_list, examples, tiny_bert
    namespace.update(model=tiny_bert(), train=as_list(examples()) * 22)  # 528 examples: one logical batch of 512
    run_block(blocks[2], namespace)  # the Trainer
    assert namespace["trainer"].epsilon() <= 3.0
