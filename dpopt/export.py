"""The trained model as published: ``export_model`` writes it without any secret (no key, optimizer or ledger)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dpopt.checkpoint import write_atomic

MODEL_DIR = "model"


def export_model(model: nn.Module, folder: Path, tokenizer: str | None = None,
                 weights: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the trained model for publishing, with no secret in it: ``save_pretrained`` for a Hugging Face
    model (with the tokenizer saved in the folder ``tokenizer``, if given), else ``model.pt`` holding only the
    state_dict (parameters and buffers). Never the checkpoint, which holds the secret key, the optimizer and
    the ledger. ``weights``: the state_dict to write instead of the model's own (a sharded model's, gathered)."""
    folder.mkdir(parents=True, exist_ok=True)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(folder, state_dict=weights)
        if tokenizer is not None:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tokenizer).save_pretrained(folder)
        return folder
    state = model.state_dict() if weights is None else weights
    return write_atomic(folder / "model.pt", lambda f: torch.save(state, f))
