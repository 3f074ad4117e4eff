"""The language-model workloads' next-token loss taken over chunks of positions (``model_shapes.causal_lm_loss``)
is the loss taken at once: the same per-example losses, gradients and per-example gradients (hooks included)."""

import pytest
import torch
from transformers import OPTConfig

from dpopt import model_shapes
from dpopt.grad import PerExampleEngine


def tiny_opt() -> torch.nn.Module:
    torch.manual_seed(0)
    _, numbers = model_shapes._opt(32, 2, 4, vocab_size=96, max_position_embeddings=32)
    return model_shapes.causal_lm(OPTConfig(**numbers)).eval()


def batch(examples: int = 3, positions: int = 10) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 96, (examples, positions), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def chunked(chunk: int | None):
    return lambda model, data: model_shapes.causal_lm_loss(model, data, chunk)


@pytest.mark.parametrize("chunk", [1, 4, 9, 64])  # 9 positions: one each, uneven chunks, one chunk, more than all
def test_chunked_losses_and_gradients_equal_the_loss_taken_at_once(chunk):
    model, data = tiny_opt(), batch()
    params = list(model.parameters())
    results = []
    for c in (chunk, None):
        losses = chunked(c)(model, data)
        results.append((losses.detach(), torch.autograd.grad(losses.sum(), params)))
    (losses, grads), (reference, reference_grads) = results
    assert losses.shape == (3,) and losses.dtype == torch.float32
    torch.testing.assert_close(losses, reference, rtol=0, atol=1e-6)
    for g, r in zip(grads, reference_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-6)


def test_per_example_gradients_through_the_chunked_loss_are_attributed_as_at_once():
    """The engine's hooks see the output layer once per forward either way; the checkpointed chunks recompute
    only the cross-entropy, in the backward pass."""
    model, data = tiny_opt(), batch(4)
    got, reference = (PerExampleEngine(model, chunked(c)).gradients(data).materialize() for c in (4, None))
    for g, r in zip(got, reference):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-6)
    PerExampleEngine(model, chunked(4)).verify(data)


def test_the_chunked_loss_runs_without_gradients_and_under_bf16_autocast():
    model, data = tiny_opt(), batch()
    with torch.no_grad():
        torch.testing.assert_close(chunked(4)(model, data), chunked(None)(model, data), rtol=0, atol=1e-6)
        with torch.autocast("cpu", torch.bfloat16):
            torch.testing.assert_close(chunked(4)(model, data), chunked(None)(model, data), rtol=0, atol=1e-6)
