"""Real datasets that work offline (see the project's DATA.md).

Files are looked for in ``$DPOPT_DATA``, ``~/.cache/dpopt``, ``./data``, the ``shared/data`` folder beside
the checkout, and the system locations of Debian's packages. Nothing is downloaded unless asked
(``download=True``); a missing dataset raises ``DatasetNotFound`` saying how to get it.
"""

from __future__ import annotations

import gzip
import os
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch


class DatasetNotFound(FileNotFoundError):
    pass


@dataclass
class Dataset:
    """Train and test splits as (inputs, labels) tensors, or as dicts of tensors with a "labels" entry
    (tokenized text: input_ids, attention_mask); ``classes`` names the labels where the data does, ``note``
    says how a user's file was read."""

    name: str
    train: Any
    test: Any
    num_classes: int
    classes: tuple[str, ...] | None = None
    note: str | None = None

    @property
    def kind(self) -> str:
        return "text" if isinstance(self.train, dict) else "image"

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple((self.train["input_ids"] if self.kind == "text" else self.train[0]).shape[1:])

    def __len__(self) -> int:
        return len(labels_of(self.train))


def labels_of(data: Any) -> torch.Tensor:
    return data["labels"] if isinstance(data, dict) else data[1]


def data_home() -> Path:
    """Where dpopt writes data it downloads or converts: ``$DPOPT_DATA``, else ``~/.cache/dpopt``."""
    return Path(os.environ.get("DPOPT_DATA", Path.home() / ".cache" / "dpopt"))


def data_roots() -> list[Path]:
    roots = [os.environ.get("DPOPT_DATA"), Path.home() / ".cache" / "dpopt", Path.cwd() / "data",
             Path.cwd().parent / "shared" / "data", Path(__file__).resolve().parents[3] / "shared" / "data",
             "/usr/share/datasets"]
    return list(dict.fromkeys(Path(r) for r in roots if r))  # in order, once each (the working folder may be one)


def _find(folder: str, files: list[str]) -> Path | None:
    for root in data_roots():
        if all((root / folder / f).is_file() for f in files):
            return root / folder
    return None


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def _idx_dataset(name: str, folder: str, files: dict[str, str], urls: list[str], how_to_get: str,
                 download: bool, mean: float, std: float) -> Dataset:
    where = _find(folder, list(files.values()))
    if where is None and download:
        where = _download(folder, list(files.values()), urls)
    if where is None:
        looked = ", ".join(str(r / folder) for r in data_roots())
        raise DatasetNotFound(f"{name} is not on disk (looked in {looked}). {how_to_get}")

    def images(key: str) -> torch.Tensor:
        x = torch.from_numpy(_read_idx(where / files[key]).astype(np.float32) / 255.0)
        return ((x - mean) / std).unsqueeze(1)

    def labels(key: str) -> torch.Tensor:
        return torch.from_numpy(_read_idx(where / files[key]).astype(np.int64))

    return Dataset(name, (images("train_x"), labels("train_y")), (images("test_x"), labels("test_y")), 10)


def _download(folder: str, files: list[str], urls: list[str]) -> Path | None:
    target = data_home() / folder
    target.mkdir(parents=True, exist_ok=True)
    for base in urls:
        try:
            for f in files:
                if not (target / f).is_file():
                    tmp = target / (f + ".part")
                    urllib.request.urlretrieve(base + f, tmp)
                    tmp.replace(target / f)
            return target
        except OSError:
            continue
    return None


def mnist(download: bool = False) -> Dataset:
    files = {"train_x": "train-images-idx3-ubyte.gz", "train_y": "train-labels-idx1-ubyte.gz",
             "test_x": "t10k-images-idx3-ubyte.gz", "test_y": "t10k-labels-idx1-ubyte.gz"}
    return _idx_dataset("MNIST", "mnist", files, ["https://ossci-datasets.s3.amazonaws.com/mnist/"],
                        "Put the four standard IDX .gz files in $DPOPT_DATA/mnist/ (or pass --download).",
                        download, 0.1307, 0.3081)


def fashion_mnist(download: bool = False) -> Dataset:
    files = {"train_x": "train-images-idx3-ubyte.gz", "train_y": "train-labels-idx1-ubyte.gz",
             "test_x": "t10k-images-idx3-ubyte.gz", "test_y": "t10k-labels-idx1-ubyte.gz"}
    return _idx_dataset("Fashion-MNIST", "fashion-mnist", files,
                        ["http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"],
                        "On Debian: `apt-get install -y dataset-fashion-mnist`; or put the IDX .gz files in "
                        "$DPOPT_DATA/fashion-mnist/ (or pass --download).", download, 0.2860, 0.3530)


def digits(download: bool = False) -> Dataset:
    """scikit-learn's 8x8 digits (1797 images, bundled), split 80/20 with a fixed seed."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x.astype(np.float32) / 16.0, y, test_size=0.2, random_state=0,
                                              stratify=y)
    t = lambda a, dt: torch.tensor(a, dtype=dt)  # noqa: E731
    return Dataset("digits", (t(x_tr, torch.float32).view(-1, 1, 8, 8), t(y_tr, torch.int64)),
                   (t(x_te, torch.float32).view(-1, 1, 8, 8), t(y_te, torch.int64)), 10)


def mnist1d(download: bool = False) -> Dataset:
    """MNIST-1D (4000/1000 sequences of length 40), built locally by the ``mnist1d`` package."""
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as e:
        raise DatasetNotFound("MNIST-1D needs the mnist1d package: `pip install 'dpopt[data]'` "
                              "(or `pip install mnist1d`); it builds the data locally, offline") from e
    d = make_dataset(get_dataset_args())
    x = lambda a: torch.tensor(a, dtype=torch.float32).unsqueeze(1)  # noqa: E731
    y = lambda a: torch.tensor(a, dtype=torch.int64)  # noqa: E731
    return Dataset("mnist1d", (x(d["x"]), y(d["y"])), (x(d["x_test"]), y(d["y_test"])), 10)


def _text(name: str) -> Callable[..., Dataset]:
    def load(download: bool, tokenizer: Any = None) -> Dataset:
        from dpopt.data import text

        loaders = {"rotten-tomatoes": text.rotten_tomatoes, "rotten-tomatoes-512": text.rotten_tomatoes_512}
        return loaders[name](download, tokenizer=tokenizer)

    return load


TEXT_DATASETS = {name: _text(name) for name in ("rotten-tomatoes", "rotten-tomatoes-512")}  # take a tokenizer
DATASETS: dict[str, Callable[[bool], Dataset]] = {
    "digits": digits, "mnist": mnist, "fashion-mnist": fashion_mnist, "mnist1d": mnist1d, **TEXT_DATASETS}


def check_dataset(name: str) -> None:
    """Refuse a dataset that is neither a built-in name nor a readable path (``dpopt.data.files``)."""
    if name in DATASETS:
        return
    if not (Path(name).exists() or Path(name).suffix or "/" in name or os.sep in name):
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}, or give a CSV, JSONL or "
                         "Parquet file or a datasets.save_to_disk folder")
    from dpopt.data.files import check_path

    check_path(name)


def load_dataset(name: str, download: bool = False, text_column: str = "text", label_column: str = "label",
                 tokenizer: Any = None) -> Dataset:
    """A built-in dataset by name, or the user's own from a file or folder (``dpopt.data.files``: the columns
    apply to those). ``tokenizer`` tokenizes text (``dpopt.data.text.tokenize``: a tokenizer's folder, an
    encoder such as ``dpopt.models.text_encoder("smollm2")``, or None for MiniLM's tokenizer)."""
    check_dataset(name)
    if name in TEXT_DATASETS:
        return TEXT_DATASETS[name](download, tokenizer)
    if name in DATASETS:
        return DATASETS[name](download)
    from dpopt.data.files import load_file

    return load_file(name, text_column, label_column, tokenizer)


def _tabular(name: str) -> Callable[[bool], Dataset]:
    def load(download: bool) -> Dataset:
        from dpopt.data import tabular

        return tabular.tabular(name, download)

    return load


# Tabular binary sets (dpopt/data/tabular.py): scikit-learn's breast cancer, and Debian's R data packages.
DATASETS.update({name: _tabular(name) for name in ("breast-cancer", "sonar", "ionosphere", "pima", "golub")})

DEFAULT_EPOCHS = 20  # passes over the training set unless a run says otherwise
# Golub's 30 training examples afford one full-batch step at epsilon 2: twenty leave dp-sgd below the majority
# class (docs/defaults.md).
DATASET_EPOCHS = {"golub": 1}


def default_epochs(dataset: str) -> int:
    """The passes a run over ``dataset`` makes unless it gives ``epochs``."""
    return DATASET_EPOCHS.get(dataset, DEFAULT_EPOCHS)


DEFAULT_MODEL = "mlp"  # the model a run trains unless it names one, except on the sets below
# Golub's 30 examples of 3,051 genes: the MLP's 390,914 weights leave dp-sgd at the majority class at epsilon 2, the
# logistic regression's 6,104 learn; text sets take the sentence embedder, as the MLP takes no text (docs/defaults.md).
DATASET_MODEL = {"golub": "logreg", "rotten-tomatoes": "minilm", "rotten-tomatoes-512": "minilm"}


def default_model(dataset: str) -> str:
    """The model a run on ``dataset`` trains unless it gives ``model``."""
    return DATASET_MODEL.get(dataset, DEFAULT_MODEL)
