"""Small tabular binary classification sets that work offline (DATA.md, "Tabular / convex problems").

* ``breast-cancer`` — scikit-learn's Wisconsin diagnostic set (569 × 30), bundled.
* ``sonar`` (208 × 60), ``ionosphere`` (351 × 33), ``pima`` (768 × 8) — from Debian's ``r-cran-mlbench``.
* ``golub`` — Golub et al.'s leukemia set (38 × 3051, p ≫ n) from Debian's ``r-bioc-multtest``; it stands
  in for LIBSVM's leukemia set.

The Debian files are R data (``.rda``/``.RData``) read with PyPI ``rdata``; they are looked for in
``mlbench/`` and ``multtest/`` under the data roots (``$DPOPT_DATA``, ``~/.cache/dpopt``, ...) and in R's
site library. ``tabular_arrays`` gives the raw features and {0, 1} labels; ``load_dataset`` gives a
standardised, stratified 80/20 split.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch

from dpopt.data.datasets import Dataset, DatasetNotFound, data_roots
from dpopt.extras import require

R_LIBRARY = Path("/usr/lib/R/site-library")
DEBIAN = {"mlbench": "r-cran-mlbench", "multtest": "r-bioc-multtest"}
# name -> (R package, file, object, label column or object, positive label)
SOURCES = {
    "sonar": ("mlbench", "Sonar.rda", "Sonar", "Class", "M"),
    "ionosphere": ("mlbench", "Ionosphere.rda", "Ionosphere", "Class", "good"),
    "pima": ("mlbench", "PimaIndiansDiabetes.rda", "PimaIndiansDiabetes", "diabetes", "pos"),
    "golub": ("multtest", "golub.RData", "golub", "golub.cl", 1.0),
}
TABULAR = ("breast-cancer", *SOURCES)


def _r_file(package: str, file: str) -> Path:
    places = [root / package for root in data_roots()] + [R_LIBRARY / package / "data"]
    for place in places:
        if (place / file).is_file():
            return place / file
    deb = DEBIAN[package]
    raise DatasetNotFound(
        f"{file} of the R package {package} is not on disk (looked in {', '.join(map(str, places))}). Get it "
        f"without installing R: `apt-get download {deb} && dpkg-deb -x {deb}_*.deb /tmp/{package} && mkdir -p "
        f"~/.cache/dpopt/{package} && cp /tmp/{package}/usr/lib/R/site-library/{package}/data/* ~/.cache/dpopt/{package}/`")


def tabular_arrays(name: str) -> tuple[np.ndarray, np.ndarray]:
    """Raw features [N, d] (float64) and labels in {0, 1} of a tabular set."""
    if name == "breast-cancer":
        from sklearn.datasets import load_breast_cancer

        x, y = load_breast_cancer(return_X_y=True)
        return x.astype(np.float64), (y == 0).astype(np.int64)  # 1 = malignant
    if name not in SOURCES:
        raise ValueError(f"unknown tabular dataset {name!r}; choose one of {', '.join(TABULAR)}")
    package, file, obj, label, positive = SOURCES[name]
    path = _r_file(package, file)
    rdata = require("rdata", "tabular", f"reading {name} (an R data file)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rdata: "Unknown encoding. Assumed ASCII."
        data = rdata.read_rda(str(path))
    if name == "golub":  # genes x samples matrix, class vector (0 = ALL, 1 = AML)
        return np.asarray(data[obj], dtype=np.float64).T, (np.asarray(data[label]) == positive).astype(np.int64)
    frame = data[obj]
    y = (frame[label].astype(str) == positive).to_numpy().astype(np.int64)
    features = frame.drop(columns=[label])
    x = np.column_stack([features[c].astype(str).astype(float) if features[c].dtype.name == "category"
                         else features[c].to_numpy(dtype=np.float64) for c in features.columns])
    x = x[:, x.std(0) > 0]  # Ionosphere's second column is constant
    return x, y


def tabular(name: str, download: bool = False) -> Dataset:
    """A standardised (train statistics), stratified 80/20 split of a tabular set."""
    from sklearn.model_selection import train_test_split

    x, y = tabular_arrays(name)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    mean, std = x_tr.mean(0), x_tr.std(0) + 1e-12
    f = lambda a: torch.tensor((a - mean) / std, dtype=torch.float32)  # noqa: E731
    return Dataset(name, (f(x_tr), torch.tensor(y_tr)), (f(x_te), torch.tensor(y_te)), 2)
