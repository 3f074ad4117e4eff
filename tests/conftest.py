import dataclasses
import warnings

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        yield


@pytest.fixture
def float64_digits(monkeypatch):
    """dpopt train's runs on digits in float64 (model and data), where sums taken in another order or another code
    path agree to 1e-9."""
    from dpopt.run import build

    load = build.load_dataset

    def load_float64(*args):
        data = load(*args)
        return dataclasses.replace(data, train=(data.train[0].double(), data.train[1]),
                                   test=(data.test[0].double(), data.test[1]))

    monkeypatch.setattr(build, "load_dataset", load_float64)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(default)
