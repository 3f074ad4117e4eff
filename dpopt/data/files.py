"""The user's own data: a CSV, JSONL or Parquet file, or a ``datasets.save_to_disk`` folder, read with
Hugging Face ``datasets``.

A text column is tokenized (with the model's tokenizer, else MiniLM's) into the tensors the built-in text
sets hold, so every text model takes it; a file without one may hold numeric feature columns only, which
become a float tensor used as given (no scaling). Labels are integers >= 0, or strings numbered in sorted
order. The test split is a saved ``DatasetDict``'s ``test`` split, else a fixed-seed 10% held out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpopt.data.datasets import Dataset
from dpopt.extras import require

FILE_TYPES = {".csv": "csv", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
HELD_OUT = 0.1  # the test fraction of a file without a test split, drawn with seed 0
SAVED = ("dataset_dict.json", "state.json")  # what marks a datasets.save_to_disk folder (DatasetDict, Dataset)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def check_path(path: str | Path) -> None:
    """Refuse a path that is missing, of an unknown file type, or a folder not written by ``save_to_disk``."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"no such file or folder: {path}")
    if p.is_dir() and not any((p / f).is_file() for f in SAVED):
        raise ValueError(f"{path} is a folder but not a datasets.save_to_disk folder (it has no {' or '.join(SAVED)})")
    if p.is_file() and p.suffix.lower() not in FILE_TYPES:
        raise ValueError(f"unknown file type {p.suffix or '(no suffix)'!r} of {path}: give a .csv, .jsonl, .json "
                         "or .parquet file, or a datasets.save_to_disk folder")


def _read(path: Path) -> tuple[Any, Any, str]:
    """The train split, the test split (None: none saved) and how they were found."""
    datasets = require("datasets", "files", "a dataset file")
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    if path.is_dir():
        data = datasets.load_from_disk(str(path))
        if not isinstance(data, datasets.DatasetDict):
            return data, None, "a saved Dataset"
        if "train" not in data:
            raise ValueError(f"{path} holds the splits {', '.join(data)} and no 'train' split")
        return data["train"], data.get("test"), "a saved DatasetDict"
    kind = FILE_TYPES[path.suffix.lower()]
    try:
        return datasets.load_dataset(kind, data_files=str(path), split="train"), None, f"a {kind} file"
    except datasets.exceptions.DatasetGenerationError as e:
        cause = str(e.__cause__ or e).strip().splitlines()[0]
        raise ValueError(f"cannot read {path} as {kind}: {cause}") from None


def _hold_out(train: Any) -> tuple[Any, Any]:
    n = len(train)
    if n < 2:
        raise ValueError(f"{n} rows are too few to hold out a test split")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    cut = max(1, round(HELD_OUT * n))
    return train.select(order[cut:]), train.select(order[:cut])


def _labels(train: Any, test: Any, column: str) -> tuple[list[int], list[int], int, tuple[str, ...] | None]:
    """Label ids of both splits, the number of classes and the class names (None: the labels were ids)."""
    datasets = require("datasets", "files", "a dataset file")
    feature = train.features[column]
    if isinstance(feature, datasets.ClassLabel):
        return list(train[column]), list(test[column]), feature.num_classes, tuple(feature.names)
    tr, te = list(train[column]), list(test[column])
    values = tr + te
    if all(isinstance(v, str) for v in values):
        names = sorted(set(values))
        ids = {name: i for i, name in enumerate(names)}
        tr, te, classes = [ids[v] for v in tr], [ids[v] for v in te], tuple(names)
    else:
        bad = next((v for v in values if not isinstance(v, int) or v < 0), None)
        if bad is not None:
            raise ValueError(f"label column {column!r} must hold integers >= 0 or strings; it holds {bad!r}")
        classes = None
    count = len(classes) if classes else max(values) + 1
    if count < 2:
        raise ValueError(f"label column {column!r} holds a single class; a classifier needs at least two")
    return tr, te, count, classes


def _features(split: Any, columns: list[str]) -> torch.Tensor:
    arrays = split.with_format("numpy")
    x = torch.tensor(np.column_stack([arrays[c][:].astype(np.float32) for c in columns]))
    if not torch.isfinite(x).all():
        raise ValueError(f"the feature columns {', '.join(columns)} hold missing or non-finite values")
    return x


def _texts(split: Any, column: str) -> list[str]:
    texts = list(split[column])
    bad = [t for t in texts if not isinstance(t, str)]
    if bad:
        raise ValueError(f"text column {column!r} must hold strings; it holds {bad[0]!r}")
    return texts


def load_file(path: str | Path, text_column: str = "text", label_column: str = "label",
              tokenizer: Any = None) -> Dataset:
    """The dataset in ``path`` (see the module docstring); ``tokenizer``: the folder of the tokenizer for its
    text, or an encoder of texts and labels (``dpopt.data.text.tokenize``; None: MiniLM's tokenizer)."""
    from dpopt.data.text import tokenize

    check_path(path)
    path = Path(path)
    train, test, found = _read(path)
    split = "its own test split"
    if test is None:
        train, test = _hold_out(train)
        split = f"a fixed-seed {HELD_OUT:.0%} held out as the test split"
    columns = train.column_names
    needed = [(label_column, "--label-column")] + ([(text_column, "--text-column")] if text_column in columns else [])
    for name, flag in needed:
        for part, where in ((train, ""), (test, " in its test split")):
            if name not in part.column_names:
                raise ValueError(f"{path} has no column {name!r}{where}; its columns are "
                                 f"{', '.join(part.column_names)} (choose one with {flag})")
    tr_y, te_y, classes, names = _labels(train, test, label_column)
    if text_column in columns:
        if isinstance(tokenizer, str) and not any((Path(tokenizer) / f).is_file() for f in TOKENIZER_FILES):
            raise ValueError(f"the model folder {tokenizer} holds no tokenizer for the text column {text_column!r} "
                             "(save one there with tokenizer.save_pretrained)")
        train_t, test_t = (tokenize(_texts(s, text_column), y, tokenizer) for s, y in ((train, tr_y), (test, te_y)))
        what = f"text column {text_column!r}, tokenized with " + (
            f"{tokenizer}" if callable(tokenizer) else f"{tokenizer or 'MiniLM'}'s tokenizer")
    else:
        features = [c for c in columns if c != label_column]
        numeric = [c for c in features if getattr(train.features[c], "dtype", "").startswith(("int", "float", "bool"))]
        if not features or numeric != features:
            raise ValueError(f"{path} has no text column {text_column!r} (and not only numeric feature columns); "
                             f"its columns are {', '.join(columns)} (choose one with --text-column)")
        train_t = (_features(train, features), torch.tensor(tr_y, dtype=torch.int64))
        test_t = (_features(test, features), torch.tensor(te_y, dtype=torch.int64))
        what = f"{len(features)} numeric feature columns (no text column {text_column!r})"
    note = (f"dataset {path} ({found}): {len(tr_y)} training and {len(te_y)} test examples ({split}), "
            f"{classes} classes from label column {label_column!r}, {what}")
    return Dataset(path.name, train_t, test_t, classes, names, note)
