"""The datasets the core ships (digits, MNIST, Fashion-MNIST, MNIST-1D) and its models (no BatchNorm)."""

import socket

import pytest
import torch
from torch import nn

from dpopt.data import datasets
from dpopt.models import IMAGE_MODELS, build_model
from dpopt.run import TrainConfig, train
from helpers import quiet


def test_mnist1d_is_built_offline_and_trains(monkeypatch):
    pytest.importorskip("mnist1d")  # the [data] extra, which the test extra installs
    def no_network(*args, **kwargs):
        raise OSError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    data = datasets.load_dataset("mnist1d")
    assert data.train[0].shape == (4000, 1, 40) and data.test[0].shape == (1000, 1, 40)
    assert torch.bincount(data.train[1], minlength=10).min() > 350  # ten balanced classes
    monkeypatch.setitem(datasets.DATASETS, "mnist1d", lambda download=False: data)
    m = train(TrainConfig(dataset="mnist1d", model="mlp", epochs=1, epsilon=2.0), progress=False, log=lambda s: None)
    assert m["dataset"] == "mnist1d" and m["epsilon"] <= 2.0 and m["test_accuracy"] > 0.1


def test_fashion_mnist_loads_from_debians_path():
    try:
        data = datasets.load_dataset("fashion-mnist")
    except datasets.DatasetNotFound:
        pytest.skip("Fashion-MNIST is not installed (apt-get install -y dataset-fashion-mnist)")
    assert data.train[0].shape == (60000, 1, 28, 28) and data.test[0].shape == (10000, 1, 28, 28)
    assert torch.bincount(data.train[1]).tolist() == [6000] * 10
    assert abs(float(data.train[0].mean())) < 1e-2 and abs(float(data.train[0].std()) - 1) < 1e-2  # normalised


@pytest.mark.parametrize("name", sorted(IMAGE_MODELS))
def test_models_have_no_batchnorm(name):
    data = datasets.Dataset("fake", (torch.zeros(2, 1, 28, 28), torch.zeros(2, dtype=torch.long)), None, 10)
    model = build_model(name, data)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert model(torch.randn(3, 1, 28, 28)).shape == (3, 10)


def test_cnn_is_the_tanh_cnn_of_the_dp_literature():
    """Papernot et al. (2021): conv 16@8x8/2, maxpool 2/1, conv 32@4x4/2, maxpool 2/1, fc 32, fc 10, Tanh."""
    data = datasets.Dataset("fake", (torch.zeros(2, 1, 28, 28), torch.zeros(2, dtype=torch.long)), None, 10)
    model = build_model("cnn", data)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert [(c.out_channels, c.kernel_size, c.stride) for c in convs] == [(16, (8, 8), (2, 2)), (32, (4, 4), (2, 2))]
    assert sum(p.numel() for p in model.parameters()) == 26010
    assert sum(isinstance(m, nn.Tanh) for m in model.modules()) == 3


def test_a_sentence_classifier_mean_pools_over_the_real_tokens_only():
    """minilm's head reads the encoder's sentence embedding (mean over unmasked tokens, unit norm): padding an
    input changes nothing, and the embedding is a unit vector."""
    transformers = pytest.importorskip("transformers")
    from dpopt.models import SentenceClassifier

    torch.manual_seed(0)
    encoder = transformers.BertModel(transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1,
                                                             num_attention_heads=2, intermediate_size=32),
                                     add_pooling_layer=False).eval()
    model = SentenceClassifier(encoder, 3)
    ids = torch.randint(1, 40, (2, 5))
    padded = torch.cat([ids, torch.randint(1, 40, (2, 3))], 1)
    mask = torch.cat([torch.ones(2, 5, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long)], 1)
    plain = model(input_ids=ids, attention_mask=torch.ones(2, 5, dtype=torch.long))
    assert plain.shape == (2, 3) and model.head.bias is not None
    assert torch.allclose(model(input_ids=padded, attention_mask=mask), plain, atol=1e-6)
    assert not torch.allclose(model(input_ids=padded, attention_mask=torch.ones_like(mask)), plain, atol=1e-3)
    assert torch.allclose(model.embed(ids, torch.ones(2, 5, dtype=torch.long)).norm(dim=1), torch.ones(2))


def test_a_models_default_trainable_set_is_resolved_in_the_config_and_trains_only_it(monkeypatch):
    """A model may name the weights it trains by default (minilm: its head); the config holds the pattern, a
    given --trainable wins ('.' trains every weight), and the run freezes the rest and says whose default it is."""
    from dpopt import models
    from dpopt.run import build_run

    assert TrainConfig(model="minilm").trainable == models.MODEL_TRAINABLE["minilm"] == r"^head\."
    assert TrainConfig(model="minilm", trainable=".").trainable == "."
    assert TrainConfig(model="mlp").trainable is None and TrainConfig(model="minilm-cls").trainable is None
    assert TrainConfig.from_dict(TrainConfig(model="minilm").to_dict()).trainable == r"^head\."

    monkeypatch.setitem(models.MODEL_TRAINABLE, "mlp", r"^3\.")
    lines: list[str] = []
    config = TrainConfig(model="mlp", epochs=1, epsilon=2.0, secret_seed=0)
    run = build_run(config, log=lines.append)
    assert any("mlp's default; --trainable . trains every weight" in line for line in lines)
    assert [n for n, p in run.model.named_parameters() if p.requires_grad] == ["3.weight", "3.bias"]
    everything = build_run(TrainConfig(model="mlp", epochs=1, epsilon=2.0, trainable="."), log=quiet)
    assert all(p.requires_grad for p in everything.model.parameters())
