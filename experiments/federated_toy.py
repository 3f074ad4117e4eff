"""Theorem 1 and Figure 1 of Islamov et al. (spec clip21_sgd2m.md §4.2, §8.1): Clip21-SGD does not converge
under stochastic gradients, and does not improve with more clients; Clip21-SGD2M does.

Problem: f_i(x) = (L/2)||x||^2 in R^2, L = 2, for every client; stochastic gradient L x + xi with xi uniform
over {s(3,0), s(0,4), s(-3,-4)}, s = sqrt(3 sigma^2/100), sigma = 5 (mean 0, sub-Gaussian). x0 = (0, -0.07),
gamma = 0.01 = 1/sqrt(T), T = 10^4, tau in {1, 0.1, 0.01}, no DP noise. All methods run through the
federated simulator (dpopt.federated) with this oracle; the "ideal" method (6), which needs exact gradients,
is a direct probe. Checks: E[clip_tau(xi)] = (tau/15)(2, 1) by enumeration; method (6) against its closed
form for E[x^T] and the Theorem 1 bound; the spec's pass criteria for the plateaus.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch

from dpopt.federated.config import FederatedConfig, build_setup
from dpopt.federated.problem import Problem
from dpopt.federated.simulator import InProcessFederation

L, SIGMA, GAMMA = 2.0, 5.0, 0.01
S = math.sqrt(3 * SIGMA ** 2 / 100)
POINTS = torch.tensor([[3.0, 0.0], [0.0, 4.0], [-3.0, -4.0]], dtype=torch.float64) * S
X0 = torch.tensor([0.0, -0.07], dtype=torch.float64)
TAUS = (1.0, 0.1, 0.01)
METHODS = {  # name -> (algorithm, beta, tau override)
    "Clip21-SGD": ("clip21-sgd", 1.0, None),
    "Clip21-SGD2M b=0.08": ("clip21-sgd2m", 0.08, None),
    "Clip21-SGD2M b=0.1": ("clip21-sgd2m", 0.1, None),
    "Clip21-SGD2M b=0.12": ("clip21-sgd2m", 0.12, None),
    "SGD (no clipping)": ("clip-sgd", 1.0, 1e12),
}


def toy_problem(clients: int, seed: int) -> Problem:
    gen = torch.Generator().manual_seed(seed)

    def oracle(x: torch.Tensor, who: list[int], round: int) -> torch.Tensor:
        xi = POINTS[torch.randint(0, 3, (len(who),), generator=gen)]
        return L * x + xi

    return Problem(oracle, X0.clone(), [2], [1] * clients, lambda x: {})


def run(method: str, tau: float, clients: int, seed: int, rounds: int) -> list[float]:
    """f(x^t) - f* = (L/2)||x^t||^2 after every round."""
    algorithm, beta, override = METHODS[method]
    kw = dict(beta=beta, beta_hat=1.0) if algorithm == "clip21-sgd2m" else {}
    config = FederatedConfig(algorithm=algorithm, clients=clients, rounds=rounds, noise_multiplier=0.0,
                             clip=override or tau, lr=GAMMA, seed=seed, **kw)
    fed = InProcessFederation(build_setup(config, toy_problem(clients, seed)))
    out = []
    for _ in range(rounds):
        fed.step()
        out.append(float(L / 2 * fed.server.x.square().sum()))
    return out


def ideal(tau: float, seed: int, rounds: int) -> list[float]:
    """Method (6) with n = 1: x <- (1 - L gamma) x - gamma clip_tau(xi)."""
    gen = torch.Generator().manual_seed(seed)
    x, out = X0.clone(), []
    for _ in range(rounds):
        xi = POINTS[int(torch.randint(0, 3, (1,), generator=gen))]
        x = (1 - L * GAMMA) * x - GAMMA * xi * min(1.0, tau / float(xi.norm()))
        out.append(float(L / 2 * x.square().sum()))
    return out


def tail(curve: list[float], last: int) -> float:
    return statistics.mean(curve[-last:])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dpopt reproduce federated_toy")
    p.add_argument("--rounds", type=int, default=10_000)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 10, 100], help="the n-scan (right panel)")
    p.add_argument("--n-scan-tau", type=float, default=0.1)
    p.add_argument("--out", default="experiments/results/federated")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = range(a.seeds)
    checks: dict[str, object] = {}
    # exact enumeration of E[clip(xi)] and the Theorem 1 quantities
    for tau in TAUS:
        mean_clip = (POINTS * (tau / POINTS.norm(dim=1)).clamp(max=1).unsqueeze(1)).mean(0)
        checks[f"E[clip(xi)] tau={tau}"] = [mean_clip.tolist(), (tau / 15 * torch.tensor([2.0, 1.0])).tolist()]
    results: dict[str, dict] = {"left": {}, "right": {}, "ideal": {}}
    for tau in TAUS:
        curves = [ideal(tau, s, a.rounds) for s in seeds]
        grad_sq = statistics.mean(4 * c[-1] for c in curves)  # ||grad f||^2 = L^2 ||x||^2 = 2 L f
        expected_x = (1 - L * GAMMA) ** a.rounds * X0 - tau / (15 * L) * torch.tensor([2.0, 1.0], dtype=torch.float64) \
            * (1 - (1 - L * GAMMA) ** a.rounds)
        results["ideal"][str(tau)] = {
            "mean_f_last100": statistics.mean(tail(c, 100) for c in curves), "E_grad_sq_T": grad_sq,
            "theorem1_bound": 0.5 * min(L ** 2 * float(X0.square().sum()), tau ** 2 / 45),
            "E_xT_closed_form": expected_x.tolist()}
        for method in METHODS:
            curves = [run(method, tau, 1, s, a.rounds) for s in seeds]
            results["left"].setdefault(method, {})[str(tau)] = {
                "mean_f_last100": statistics.mean(tail(c, 100) for c in curves),
                "mean_f_last1000": statistics.mean(tail(c, 1000) for c in curves),
                "curve": [statistics.mean(c[t] for c in curves) for t in range(0, a.rounds, max(1, a.rounds // 200))]}
            print(f"tau={tau:<5} n=1   {method:<22} mean f over last 1000 rounds "
                  f"{results['left'][method][str(tau)]['mean_f_last1000']:.4g}", flush=True)
    for n in a.clients:
        for method in ("Clip21-SGD", "Clip21-SGD2M b=0.1", "SGD (no clipping)"):
            if n == 1:
                value = results["left"][method][str(a.n_scan_tau)]["mean_f_last1000"]
            else:
                value = statistics.mean(tail(run(method, a.n_scan_tau, n, s, a.rounds), 1000) for s in seeds)
            results["right"].setdefault(method, {})[str(n)] = value
            print(f"tau={a.n_scan_tau:<5} n={n:<4} {method:<22} mean f over last 1000 rounds {value:.4g}", flush=True)
    c21, c2m = results["right"]["Clip21-SGD"], results["right"]["Clip21-SGD2M b=0.1"]
    n_lo, n_hi = str(min(a.clients)), str(max(a.clients))
    checks["pass: ideal method respects the Theorem 1 bound (E||grad||^2 >= bound)"] = all(
        v["E_grad_sq_T"] >= v["theorem1_bound"] for v in results["ideal"].values())
    checks["pass: Clip21-SGD plateau >= 4x Clip21-SGD2M (b=0.1) plateau at n=1, every tau"] = all(
        results["left"]["Clip21-SGD"][str(t)]["mean_f_last1000"]
        >= 4 * results["left"]["Clip21-SGD2M b=0.1"][str(t)]["mean_f_last1000"] for t in TAUS)
    checks[f"pass: Clip21-SGD plateau at n={n_hi} >= 0.5x n={n_lo}"] = c21[n_hi] >= 0.5 * c21[n_lo]
    checks[f"pass: Clip21-SGD2M plateau at n={n_hi} <= 0.05x n={n_lo}"] = c2m[n_hi] <= 0.05 * c2m[n_lo]
    checks["sgd noise floor gamma E||xi||^2 / (2L - L^2 gamma)"] = GAMMA * float(POINTS.square().sum(1).mean()) / (
        2 * L - L ** 2 * GAMMA)
    for k, v in checks.items():
        print(f"{k}: {v}")
    (out / "toy.json").write_text(json.dumps({"args": vars(a), "checks": checks, "results": results}, indent=1))
    plot(results, a, out / "toy.png")
    return 0


def plot(results: dict, a: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(TAUS) + 1, figsize=(4 * (len(TAUS) + 1), 3.2))
    for ax, tau in zip(axes, TAUS):
        for method, by_tau in results["left"].items():
            curve = by_tau[str(tau)]["curve"]
            ax.semilogy([i * max(1, a.rounds // 200) for i in range(len(curve))], curve, label=method, lw=1)
        ax.axhline(float(L / 2 * X0.square().sum()), color="k", ls=":", lw=0.8, label="f(x0)")
        ax.set_title(f"n = 1, tau = {tau}")
        ax.set_xlabel("round")
    axes[0].set_ylabel("f(x^t) - f*  (mean of seeds)")
    axes[0].legend(fontsize=6)
    ax = axes[-1]
    for method, by_n in results["right"].items():
        ns = sorted(by_n, key=int)
        ax.loglog([int(n) for n in ns], [by_n[n] for n in ns], "o-", label=method)
    ax.set_title(f"plateau vs clients (tau = {a.n_scan_tau})")
    ax.set_xlabel("clients n")
    ax.set_ylabel("mean f over last 1000 rounds")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
