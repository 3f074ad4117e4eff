"""Causal language models of real architectures at real sizes, with random weights (nothing is downloaded).

``SHAPES`` holds the configuration numbers of the public OPT checkpoints (Zhang et al. 2022, Table 1:
``facebook/opt-125m`` to ``facebook/opt-30b``), of GPT-2 small (Radford et al. 2019; its output layer is its
token table) and of three Llama checkpoints (Llama 3.2 1B and 3B, Llama 2 7B), written out so that no
configuration file is fetched. ``build`` makes the model with ``transformers``' ``AutoModelForCausalLM.from_config``
(random initialisation); on the ``meta`` device it allocates nothing, which is how ``parameter_count`` sizes a
30B model in no memory.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

_OPT = {"vocab_size": 50272, "max_position_embeddings": 2048, "activation_function": "relu",
        "do_layer_norm_before": True, "enable_bias": True}
_LLAMA_3_2 = {"vocab_size": 128256, "intermediate_size": 8192, "num_key_value_heads": 8, "rope_theta": 500000.0,
              "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}


def _opt(hidden: int, layers: int, heads: int, **extra: Any) -> tuple[str, dict[str, Any]]:
    return "opt", {**_OPT, "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
                   "ffn_dim": 4 * hidden, "word_embed_proj_dim": hidden, **extra}


SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "opt-125m": _opt(768, 12, 12),
    # OPT-350M alone projects its 512-wide embeddings in and out and normalises after each block.
    "opt-350m": _opt(1024, 24, 16, word_embed_proj_dim=512, do_layer_norm_before=False),
    "opt-1.3b": _opt(2048, 24, 32),
    "opt-2.7b": _opt(2560, 32, 32),
    "opt-6.7b": _opt(4096, 32, 32),
    "opt-13b": _opt(5120, 40, 40),
    "opt-30b": _opt(7168, 48, 56),
    "gpt2": ("gpt2", {"vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024,
                      "tie_word_embeddings": True}),
    "llama-1b": ("llama", {**_LLAMA_3_2, "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32}),
    "llama-3b": ("llama", {**_LLAMA_3_2, "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24}),
    "llama-7b": ("llama", {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                           "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}),
}


def check_shape(name: str) -> None:
    """:raises ValueError: ``name`` is not in ``SHAPES`` (the message lists the sizes)."""
    if name not in SHAPES:
        raise ValueError(f"unknown model size {name!r} (sizes: {', '.join(SHAPES)})")


def config_of(name: str) -> Any:
    """The ``transformers`` configuration of shape ``name``.

    :param name: a key of ``SHAPES``.
    :returns: an ``OPTConfig``, ``GPT2Config`` or ``LlamaConfig``.
    :raises ValueError: an unknown name.
    """
    check_shape(name)
    from transformers import GPT2Config, LlamaConfig, OPTConfig

    family, numbers = SHAPES[name]
    return {"opt": OPTConfig, "gpt2": GPT2Config, "llama": LlamaConfig}[family](**numbers)


def causal_lm(config: Any, device: str | torch.device = "cpu") -> nn.Module:
    """A causal language model of ``config`` with random weights, built on ``device`` (``"meta"``: shapes only,
    no memory), in training mode.

    :param config: a ``transformers`` configuration of a causal language model.
    :param device: where the weights are allocated.
    :returns: the model (``AutoModelForCausalLM.from_config``).
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        logging.set_verbosity(verbosity)
    return model.train()


def build(name: str, device: str | torch.device = "cpu") -> nn.Module:
    """``causal_lm`` of shape ``name``.

    :raises ValueError: an unknown name.
    """
    return causal_lm(config_of(name), device)


@functools.cache
def parameter_count(name: str) -> int:
    """The number of distinct parameters of shape ``name`` (tied weights once), counted on the meta device.

    :raises ValueError: an unknown name.
    """
    return sum(p.numel() for p in build(name, "meta").parameters())


# Positions whose float32 log-probabilities over the vocabulary the next-token loss forms at once.
LOSS_CHUNK = 16


def causal_lm_loss(model: nn.Module, batch: dict[str, torch.Tensor], chunk: int | None = LOSS_CHUNK) -> torch.Tensor:
    """Per-example next-token loss: the mean over positions 1..T-1 of the cross-entropy of predicting token t
    from tokens before it, one value per example ([B], float32 even under autocast).

    The cross-entropy is taken over ``chunk`` positions at a time, each chunk under ``torch.utils.checkpoint``: the
    backward pass keeps the logits (in the forward's precision) and recomputes a chunk's float32 log-probabilities
    when it reaches it, so those of the whole sequence (4 bytes x positions x vocabulary, a few hundred MB at
    batch 8, sequence 128 and a 50k vocabulary) never exist at once. The model itself runs unchanged (its output
    layer once per forward, under whatever hooks it carries).

    :param batch: ``input_ids`` [B, T] and ``attention_mask`` [B, T].
    :param chunk: positions per chunk (None: all at once, the float32 log-probabilities kept for the backward).
    """
    ids = batch["input_ids"]
    logits, targets = model(input_ids=ids, attention_mask=batch["attention_mask"]).logits[:, :-1], ids[:, 1:]
    if chunk is None:
        return _token_losses(logits, targets).mean(1)
    from torch.utils.checkpoint import checkpoint

    losses = [checkpoint(_token_losses, part, target, use_reentrant=False)
              for part, target in zip(logits.split(chunk, 1), targets.split(chunk, 1))]
    return torch.cat(losses, 1).mean(1)


def _token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The float32 cross-entropy [B, L] of logits [B, L, V] against token ids [B, L]."""
    b, length = targets.shape
    return torch.nn.functional.cross_entropy(logits.float().reshape(b * length, -1), targets.reshape(-1),
                                             reduction="none").view(b, length)
