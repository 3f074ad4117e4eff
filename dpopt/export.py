"""The trained model as published: ``export_model`` writes it without any secret (no key, optimizer or ledger)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dpopt.checkpoint import write_atomic

MODEL_DIR = "model"


def export_model(model: nn.Module, folder: Path, tokenizer: str | None = None) -> Path:
    """Write the trained model for publishing, with no secret in it: ``save_pretrained`` for a Hugging Face
    model (with the tokenizer saved in the folder ``tokenizer``, if given), else ``model.pt`` holding only the
    state_dict (parameters and buffers). Never the checkpoint, which holds the secret key, the optimizer and
    the ledger."""
    folder.mkdir(parents=True, exist_ok=True)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(folder)
        if tokenizer is not None:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tokenizer).save_pretrained(folder)
        return folder
    return write_atomic(folder / "model.pt", lambda f: torch.save(model.state_dict(), f))
