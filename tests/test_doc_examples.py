"""Every Python block of the Get started, Guides and Concepts pages runs, page by page, in order, in one namespace,
on small data (the digits set, tiny models). A page that assumes names it does not define (a `model`, a Hugging
Face `train` set) gets them from SETUP, built small here; a block marked `<!-- no-run: reason -->` is skipped and
listed with its reason. Pages that register a recipe or a layer rule leave no trace in dpopt's registries. The
`dpopt` commands of the pages' shell blocks are checked against the CLI's parsers (their flags exist), not run."""

from __future__ import annotations

import argparse
import re
import shlex
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from doc_blocks import Block, python_blocks, run_block
from test_docs_pages import DOCS, nav_pages

RUN_SECTIONS = ("Get started", "Guides", "Concepts")
NOT_RUN_PAGES = {"design.md"}  # a design document: its fragments name the engine's internals, not a user's code


def pages() -> list[str]:
    return [page for section, page in nav_pages()
            if section in RUN_SECTIONS and page not in NOT_RUN_PAGES and (DOCS / page).is_file()]


def blocks_of(page: str) -> list[Block]:
    return python_blocks(DOCS / page, page)


# ---- names a page assumes ---------------------------------------------------------------------------------------


def digits() -> dict[str, Any]:
    """The digits set as tensors, an MLP, and a per-example loss: what the plain-loop snippets call x, y, model."""
    from sklearn.datasets import load_digits

    import dpopt

    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16, dtype=torch.float32), torch.tensor(y)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))
    loss_fn = lambda model, batch: F.cross_entropy(model(batch[0]), batch[1], reduction="none")
    return {"x": x, "y": y, "train_set": (x, y), "model": model, "loss_fn": loss_fn, "torch": torch, "dpopt": dpopt}


def hugging_face() -> dict[str, Any]:
    """A tiny BERT, 528 tokenized examples (one logical batch of 512 per epoch), its tokenizer and the
    transformers names the Trainer snippets use."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from test_hf_trainer import as_list, examples, tiny_bert

    transformers.logging.set_verbosity_error()
    tokenizer = transformers.BertTokenizer(vocab={w: i for i, w in enumerate(
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(f"w{k}" for k in range(35))])})
    return {"model": tiny_bert(), "train": as_list(examples()) * 22, "test": as_list(examples()),
            "tokenizer": tokenizer, "TrainingArguments": transformers.TrainingArguments,
            "DataCollatorWithPadding": transformers.DataCollatorWithPadding}


# before block k (0-based) of a page: the names it assumes
SETUP: dict[str, Callable[[int], dict[str, Any]]] = {
    "own_loop.md": lambda k: digits() if k == 0 else hugging_face(),
    "hf_trainer.md": lambda k: hugging_face() if k == 0 else digits(),
}


# ---- what a page's run must show --------------------------------------------------------------------------------


def statement_shown(page: str) -> list[str]:
    """The lines of the page's ```text block."""
    return re.search(r"^```text\n(.*?)^```", (DOCS / page).read_text(), re.M | re.S).group(1).splitlines()


def check_privacy_statement(ns: dict[str, Any]) -> None:
    shown, printed = statement_shown("get_started/privacy_statement.md"), ns["statement"].splitlines()
    assert printed == shown[:len(printed)] and len(shown) == len(printed) + 1  # and the key's line
    assert ns["ledger"].epsilon(1e-6) > ns["ledger"].epsilon(1e-5)


def check_resume(ns: dict[str, Any]) -> None:
    optimizer = ns["optimizer"]
    assert optimizer.dp.steps == 7 * len(ns["batches"]) and len(optimizer.ledger.entries) == 1
    assert optimizer.epsilon() > 2.0  # extended past the target, with the noise it was calibrated with


def check_first_run(ns: dict[str, Any]) -> None:
    assert ns["accuracy"] > 0.5 and 0.99 * 2.0 <= ns["optimizer"].epsilon() <= 2.0  # chance: 0.1


def check_accounting(ns: dict[str, Any]) -> None:
    assert ns["budget"].get_epsilon(1e-5) > ns["ledger"].epsilon(1e-5)  # two runs cost more than one


def check_gpu_precision(ns: dict[str, Any]) -> None:
    assert ns["optimizer"].epsilon() <= 3.0 and ns["optimizer"].dp.physical_batch_size == 128


def check_extending(ns: dict[str, Any]) -> None:
    from dpopt.grad.rules import rule_for

    assert rule_for(ns["FeatureScale"](3)) is ns["feature_scale_rule"] and "dp-nesterov" in ns["dpopt"].ALGORITHMS


CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "get_started/first_run.md": check_first_run,
    "get_started/privacy_statement.md": check_privacy_statement,
    "concepts/accounting.md": check_accounting,
    "guides/gpu_precision.md": check_gpu_precision,
    "guides/resume.md": check_resume,
    "guides/extending.md": check_extending,
}


@pytest.fixture
def registries():
    """dpopt's registries (recipes, layer rules, ledger entries, audit setups) as they were before the test."""
    from dpopt.algorithms import registry
    from dpopt.audit import auditor
    from dpopt.grad import rules
    from dpopt.privacy import ledger

    kept = [getattr(registry, name) for name in ("ALGORITHMS", "CONFIGS", "DEFAULTS", "DEFAULT_NOISE",
                                                "DEFAULT_SAMPLING", "DEFAULT_TREE_DECODER", "NON_PRIVATE")]
    kept += [rules.RULES, rules.RULES_BY_NAME, rules.TOKENWISE, rules.REGISTERED, ledger.RELEASES,
             auditor.AUDIT_SETUPS]
    copies = [c.copy() for c in kept]
    yield
    for live, copy in zip(kept, copies):
        live.clear()
        live.update(copy)


@pytest.mark.parametrize("page", pages())
def test_the_pages_python_blocks_run(page, tmp_path, monkeypatch, registries):
    blocks = blocks_of(page)
    monkeypatch.chdir(tmp_path)  # what a snippet writes (checkpoints, a Trainer's output folder) lands here
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    try:
        for k, block in enumerate(blocks):
            if block.no_run:
                continue
            namespace.update(SETUP.get(page, lambda k: {})(k))
            run_block(block, namespace)
    finally:
        torch.set_num_threads(threads)
    if page in CHECKS:
        CHECKS[page](namespace)


def test_the_pages_with_checks_and_setups_are_in_the_run():
    run = set(pages())
    assert set(CHECKS) <= run and set(SETUP) <= run
    assert sum(len(blocks_of(page)) for page in run) >= 20


def test_blocks_not_run_say_why():
    skipped = [(b.page, b.line, b.no_run) for page in pages() for b in blocks_of(page) if b.no_run is not None]
    assert all(reason for _, _, reason in skipped), skipped
    assert len(skipped) <= 6, skipped  # a few, each with its reason: everything else runs
    print("\n".join(f"not run: {page}:{line}: {reason}" for page, line, reason in skipped))


def test_a_page_leaves_no_recipe_or_rule_behind():
    """The registries fixture undid what guides/extending.md registered (audit's test requires every recipe to
    have an audit setup, and the CLI lists every recipe)."""
    from dpopt import ALGORITHMS

    assert "dp-nesterov" not in ALGORITHMS


SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell|console)?\n(.*?)^```", re.M | re.S)


def dpopt_commands(page: str) -> list[str]:
    """The `dpopt ...` command lines of the page's shell blocks (continuations joined, comments dropped), except
    those eliding their flags with `...`."""
    found = []
    for block in SHELL_BLOCK.findall((DOCS / page).read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            if line.split()[:1] != ["dpopt"]:
                continue
            words = shlex.split(line, comments=True)
            if "..." not in words:
                found.append(shlex.join(words))
    return found


def flags_of(command: str) -> set[str]:
    """The option strings `dpopt COMMAND` accepts (its parser's; `--help` for `dpopt` alone)."""
    from dpopt.cli import parser

    top = parser()
    commands = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices
    return {o for a in commands[command]._actions for o in a.option_strings} if command else {"--help", "-h"}


@pytest.mark.parametrize("page", [page for page in pages() if dpopt_commands(page)])
def test_the_pages_dpopt_commands_use_flags_that_exist(page):
    """Every command and flag a page's `dpopt` lines use exists in dpopt's parser (checked, not run: the values
    name files and data a reader has)."""
    for command in dpopt_commands(page):
        words = shlex.split(command)[1:]
        name = words[0] if words and not words[0].startswith("-") else ""
        used = {w.split("=")[0] for w in words if w.startswith("-")}
        assert used <= flags_of(name), f"{page}: {command}: {sorted(used - flags_of(name))}"


def test_the_flag_check_knows_the_parsers():
    assert {"--resume", "--epsilon", "--physical-batch-size"} <= flags_of("train")
    assert "--epsilonn" not in flags_of("train")
    assert "--clients" in flags_of("federated") and "--clients" not in flags_of("train")


def test_a_block_is_found_with_its_line_and_its_no_run_reason(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n```python\na = 1\n```\n\n<!-- no-run: needs a GPU -->\n```python\nb = 2\n```\n"
                    "```bash\nc = 3\n```\n")
    first, second = python_blocks(page)
    assert (first.line, first.code, first.no_run) == (4, "a = 1\n", None)
    assert (second.line, second.code, second.no_run) == (9, "b = 2\n", "needs a GPU")
    with pytest.raises(ZeroDivisionError) as error:
        run_block(python_blocks(page)[0].__class__("page.md", 7, "x = 1 / 0\n", None), {})
    assert error.traceback[-1].lineno + 1 == 7  # the page's line, not the block's
