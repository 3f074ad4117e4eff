"""What Accelerated-DP-SRGD's clipped statistic is made of at the end of a run (docs/defaults.md, its misses on the
MNIST CNN and ViT; DP-SRGD's is the same): per-example norms of its two parts and how many examples the clip cuts.

At a run's checkpoint (``RUN/checkpoint.pt`` of ``dpopt train --algorithm accel-dp-srgd|dp-srgd ... --out RUN``), with
eta = t + 1 and the coupling's last two points x_t and x_{t-1}, for ``--examples`` training examples drawn with a
public seed (Alg. 1 line 3; one dropout draw per example for both points, as the recipe does):
    g_i = grad f(x_{t-1}; d_i),  d_i = eta (grad f(x_t; d_i) - g_i),  u_i = g_i + d_i = the clipped statistic,
the 10/50/90% quantiles of |g_i|, |d_i| and |u_i|, the share of examples with |u_i| > C, and the median of
|g_i| / |u_i| (how much of an example's statistic is its gradient: the rest is eta times its change between the two
points), and the training loss's lowest epoch against its last. Each example's gradients come from its own
backward pass, apart from dpopt's engine.

Writes ``accel_statistic.json`` and ``accel_statistic.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from dpopt.data.datasets import labels_of
from dpopt.data.samplers import take
from dpopt.run import TrainConfig, classification_loss
from dpopt.models import build_model
from dpopt.data.datasets import load_dataset
from experiments._report import write_table

QUANTILES = torch.tensor([0.1, 0.5, 0.9])


def measure(run: Path, examples: int) -> dict:
    """The statistic's parts at ``run``'s last checkpoint (an accel-dp-srgd or dp-srgd run)."""
    state = torch.load(run / "checkpoint.pt", map_location="cpu", weights_only=False)
    config = TrainConfig.from_dict(state["config"])
    coupling = state["optimizer"]["base"]
    if "x_prev" not in coupling or coupling["x_prev"] is None:
        raise ValueError(f"{run} is not an accel-dp-srgd or dp-srgd run past its first step")
    data = load_dataset(config.dataset)
    model = build_model(config.model, data)
    model.load_state_dict(state["model"])
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]

    def gradient(point: list[torch.Tensor], i: int, draw: int) -> torch.Tensor:
        with torch.no_grad():
            for p, v in zip(params, point):
                p.copy_(v)
        torch.manual_seed(draw)
        loss = classification_loss(model, take(data.train, torch.tensor([i])))
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])

    eta = float(coupling["t"] + 1)
    index = torch.randperm(len(labels_of(data.train)), generator=torch.Generator().manual_seed(0))[:examples].tolist()
    at_x = torch.stack([gradient(coupling["x"], i, k) for k, i in enumerate(index)])
    g = torch.stack([gradient(coupling["x_prev"], i, k) for k, i in enumerate(index)])
    d = eta * (at_x - g)
    u = g + d
    c = config.clip
    losses = [h["train_loss"] for h in state["history"]]
    low = min(range(len(losses)), key=losses.__getitem__)
    norms = {name: [float(f"{q:.3g}") for q in torch.quantile(v.norm(dim=1), QUANTILES)]
             for name, v in (("g", g), ("d", d), ("u", u))}
    return {"run": str(run), "dataset": config.dataset, "model": config.model, "lr": config.hyperparameters.lr,
            "step": coupling["t"], "test_accuracy": state["history"][-1]["test_accuracy"], "clip": c, **norms,
            "train_loss": {"lowest": round(losses[low], 3), "at_epoch": low + 1, "last": round(losses[-1], 3)},
            "clipped": float((u.norm(dim=1) > c).float().mean()),
            "gradient_share": round(float((g.norm(dim=1) / u.norm(dim=1)).median()), 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dpopt reproduce accel_statistic", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path,
                        help="run folders of accel-dp-srgd or dp-srgd (their checkpoint.pt)")
    parser.add_argument("--examples", type=int, default=256, help="training examples measured per run")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/accel_statistic"))
    args = parser.parse_args(argv)
    rows = [measure(run, args.examples) for run in args.runs]
    header = ["run", "pair", "lr", "step", "test acc", "|g| q10/50/90", "|eta dg| q10/50/90", "|u| q10/50/90",
              "clipped", "median |g|/|u|", "train loss: lowest (epoch), last"]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    lines += ["| " + " | ".join(map(str, [
        Path(r["run"]).name, f"{r['dataset']}/{r['model']}", f"{r['lr']:.3g}", r["step"],
        f"{100 * r['test_accuracy']:.2f}", *("/".join(map(str, r[k])) for k in ("g", "d", "u")),
        f"{r['clipped']:.2f}", r["gradient_share"],
        "{lowest} ({at_epoch}), {last}".format(**r["train_loss"])])) + " |"
        for r in rows]
    write_table(args.out, "accel_statistic", rows, lines)
    return 0
