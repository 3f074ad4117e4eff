"""Memory of fine-tuning the pretrained MiniLM (sequence 64): measured peaks and the paper's float counts.

* Measured (``dpopt bench``, each system in its own process, peak live-tensor memory of one training step
  with Adam-type updates): non-private Adam and GaLore, dpopt DP-Adam (book-keeping; materialised),
  Opacus DP-Adam (hooks; ghost), naive DP-GaLore, DP-GRAPE and DPZero, at batch 32 and 64; then DP-GRAPE over
  ranks. Written to ``OUT/memory_bB`` and ``OUT/rank_rR`` (bench.json, bench.md).
* ``--floats``: Table 2 of the paper (L130-L136) for this model: floats of the per-example statistic and of
  the optimizer states, from the parameter shapes alone (no run).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dpopt import bench
from dpopt.data.datasets import Dataset
from dpopt.grad import PerExampleEngine
from dpopt.grad.projection import engine_projectable

SYSTEMS = ("pytorch", "galore", "dpopt", "dpopt-materialize", "opacus-hooks", "opacus-ghost", "dp-galore", "dp-grape", "dpzero")


def floats(rank: int, batch: int, seq: int) -> dict[str, float]:
    """Per-example statistic and optimizer-state floats (millions) for MiniLM with a 2-class head."""
    from dpopt.models import minilm_cls

    model = minilm_cls(Dataset("floats", {"labels": torch.zeros(1)}, None, 2))
    engine = PerExampleEngine(model, lambda m, b: b)
    sides = engine_projectable(engine, rank)
    total = sum(p.numel() for p in engine.params)
    mn = sum(engine.params[i].numel() for i in sides)
    rn = sum(rank * max(engine.params[i].shape) for i in sides)
    unprojected = total - mn
    embedding = model.bert.embeddings.word_embeddings.weight
    sparse_unprojected = unprojected - embedding.numel() + seq * embedding.shape[1]  # rows of the tokens used
    m = 1e-6
    return {"parameters": total * m, "projected_weights": mn * m, "projected_statistic_per_example": rn * m,
            "unprojected": unprojected * m, "dp_adam_per_example_dense": batch * total * m,
            "dp_grape_per_example_dense": batch * (rn + unprojected) * m,
            "dp_adam_per_example_sparse_embedding": batch * (mn + sparse_unprojected) * m,
            "dp_grape_per_example_sparse_embedding": batch * (rn + sparse_unprojected) * m,
            "adam_states": 2 * total * m, "projected_adam_states": 2 * (rn + unprojected) * m}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dpopt reproduce grape_memory")
    p.add_argument("--batches", nargs="+", type=int, default=[32, 64])
    p.add_argument("--ranks", nargs="+", type=int, default=[4, 8, 16, 32, 64, 128])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--floats", action="store_true", help="only the float counts (no measurement)")
    p.add_argument("--out", default="experiments/results/grape")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    counts = {b: floats(a.rank, b, a.seq) for b in a.batches}
    (out / "floats.json").write_text(json.dumps({"rank": a.rank, "seq": a.seq, "by_batch": counts}, indent=1))
    print(json.dumps(counts, indent=1))
    if a.floats:
        return 0
    cases = [(f"memory_b{b}", bench.Case("minilm", b, a.seq, "adam", a.rank, 1), SYSTEMS) for b in a.batches]
    cases += [(f"rank_r{r}", bench.Case("minilm", a.batches[0], a.seq, "adam", r, 1), ("dp-grape",)) for r in a.ranks]
    for folder, case, systems in cases:
        rows = [(case.label, bench.compare(case, systems, warmup=1, steps=1))]
        (out / folder).mkdir(exist_ok=True)
        (out / folder / "bench.json").write_text(json.dumps({label: r for label, r in rows}, indent=2))
        (out / folder / "bench.md").write_text(bench.markdown(rows) + "\n")
        print(bench.markdown(rows), flush=True)
    return 0
