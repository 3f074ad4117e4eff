"""Per-example norms of Accelerated-DP-SRGD's statistic eta*g(x) - (eta-1)*g(x) at one point x (the fresh head),
eta = 80 (mid-run of 160 steps), MiniLM in training mode (dropout 0.1), 128 training snippets: with one random
state for both evaluations (the fix) and with fresh draws (before)."""
import torch
torch.set_num_threads(1)
from dpopt.data.datasets import load_dataset
from dpopt.models import build_model
from dpopt.run import classification_loss, freeze_all_but
from dpopt.grad import PerExampleEngine
from dpopt.data.samplers import take
data = load_dataset("rotten-tomatoes-512")
torch.manual_seed(0)
model = build_model("minilm", data); model.train(); freeze_all_but(model, r"^head\.")
engine = PerExampleEngine(model, classification_loss)
batch = take(data.train, torch.arange(128))
flat = lambda g: torch.cat([t.flatten(1) for t in g.materialize()], 1)
eta = 80.0
with engine.same_random_draws():
    same = flat(eta * engine.gradients(batch) - (eta - 1) * engine.gradients(batch))
fresh = flat(eta * engine.gradients(batch) - (eta - 1) * engine.gradients(batch))
for name, u in (("one state", same), ("fresh draws", fresh)):
    n = u.norm(dim=1)
    print(f"{name}: median norm {n.median():.3f}, max {n.max():.3f}, clipped at 1: {(n > 1).float().mean():.0%}")
