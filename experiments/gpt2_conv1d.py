"""GPT-2's Conv1D with its hook rule against the torch.func fallback it had before (issue 22): peak tensor
memory (``dpopt.bench.peak_tensor_mb``) and CPU time per DP-SGD step of a small random GPT-2 LM (2 layers,
width 256, vocabulary 1000, batch 16 x 64 tokens, tied head), beside the non-private step. One thread."""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from dpopt.algorithms import SGD, Privatizer, build_algorithm
from dpopt.bench import peak_tensor_mb
from dpopt.clipping import Clipping
from dpopt.data.samplers import FixedOrderSampler
from dpopt.grad import PerExampleEngine
from dpopt.grad import rules
from dpopt.noise.gaussian import GaussianNoise
from dpopt.noise.rng import SecretStream
from dpopt.privacy import PrivacyLedger
from experiments._report import write_table

B, T = 16, 64


def lm_loss(model, batch):
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
    return F.cross_entropy(logits.transpose(1, 2), batch["input_ids"][:, 1:], reduction="none").mean(1)


def make_step(system: str):
    import transformers as t

    torch.manual_seed(0)
    model = t.GPT2LMHeadModel(t.GPT2Config(vocab_size=1000, n_positions=T, n_embd=256, n_layer=2, n_head=4))
    data = {"input_ids": torch.randint(0, 1000, (B, T))}
    if system == "pytorch":
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step():
            lm_loss(model, data).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step
    privatizer = Privatizer(Clipping(1.0), GaussianNoise(1.0, 1.0, SecretStream(0, "noise")),
                            FixedOrderSampler(B, B, SecretStream(0, "sampling")), PrivacyLedger())
    dp = build_algorithm("dp-sgd", PerExampleEngine(model, lm_loss), privatizer, SGD(lr=0.01))
    dp.verify(data)
    return lambda: dp.step(data)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default="experiments/results/gpt2_conv1d")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    for system in ("pytorch", "dpopt, Conv1D rule", "dpopt, torch.func fallback"):
        saved = dict(rules.RULES_BY_NAME)
        if system.endswith("fallback"):
            rules.RULES_BY_NAME.clear()
        try:
            step = make_step(system)
            step()
            start = time.process_time()
            for _ in range(args.steps):
                step()
            results[system] = {"cpu_s_per_step": (time.process_time() - start) / args.steps,
                               "peak_tensor_mb": peak_tensor_mb(step)}
        finally:
            rules.RULES_BY_NAME.update(saved)
    base = results["pytorch"]
    lines = ["| system | CPU s / step | / non-private | peak tensor MB | / non-private |", "|---|---|---|---|---|"]
    for system, r in results.items():
        lines.append(f"| {system} | {r['cpu_s_per_step']:.3f} | {r['cpu_s_per_step'] / base['cpu_s_per_step']:.2f} "
                     f"| {r['peak_tensor_mb']:.1f} | {r['peak_tensor_mb'] / base['peak_tensor_mb']:.2f} |")
    write_table(args.out, "gpt2_conv1d", results, lines)


if __name__ == "__main__":
    main()
