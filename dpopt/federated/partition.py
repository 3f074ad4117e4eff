"""Which training examples each simulated client holds (public: the split is part of the simulation).

* ``iid`` — a random permutation cut into n nearly equal parts.
* ``label`` — examples sorted by label (ties in random order) and cut into n contiguous parts: each
  client sees one or two labels (the heterogeneous split of spec §8.4-8.5).
* ``dirichlet`` — per class, client shares drawn from Dirichlet(α) (Hsu et al., 2019); small α is more
  heterogeneous. Every client keeps at least one example.
A given partition (a list of index tensors) can be passed to the simulator instead.
"""

from __future__ import annotations

import numpy as np
import torch

from dpopt.noise.rng import public_generator

SPLITS = ("iid", "label", "dirichlet")


def _cut(order: torch.Tensor, clients: int) -> list[torch.Tensor]:
    return [part.sort().values for part in torch.tensor_split(order, clients)]


def partition(labels: torch.Tensor, clients: int, split: str = "iid", alpha: float = 0.5,
              seed: int = 0) -> list[torch.Tensor]:
    """Disjoint index sets, one per client, covering all examples."""
    n = len(labels)
    if not (isinstance(clients, int) and clients >= 1):
        raise ValueError(f"the number of clients must be an integer >= 1, got {clients}")
    if clients > n:
        raise ValueError(f"{clients} clients cannot each hold an example of a training set of {n}; "
                         "use fewer clients")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    gen = public_generator(seed, "federated", "partition", split)
    order = torch.randperm(n, generator=gen)
    if split == "iid":
        return _cut(order, clients)
    if split == "label":
        return _cut(order[torch.argsort(labels[order], stable=True)], clients)
    if not alpha > 0:
        raise ValueError(f"the Dirichlet concentration alpha must be > 0, got {alpha}")
    rng = np.random.default_rng(int(torch.randint(0, 2**62, (1,), generator=gen)))
    parts: list[list[torch.Tensor]] = [[] for _ in range(clients)]
    for c in labels.unique():
        members = order[labels[order] == c]
        cuts = (np.cumsum(rng.dirichlet(np.full(clients, float(alpha)))) * len(members)).round().astype(int)
        for i, chunk in enumerate(torch.tensor_split(members, cuts[:-1].tolist())):
            parts[i].append(chunk)
    out = [torch.cat(p) for p in parts]
    for i in range(clients):  # every client needs data: the largest client gives one example to an empty one
        if len(out[i]) == 0:
            j = max(range(clients), key=lambda k: len(out[k]))
            out[i], out[j] = out[j][-1:], out[j][:-1]
    return [p.sort().values for p in out]
