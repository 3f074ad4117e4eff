"""Differentially private MNIST in a plain PyTorch loop: your model, your torch optimizer, your loop.

    python examples/plain_loop.py    # about 2 minutes on 2 CPU cores; ends with {"epsilon": ..., "accuracy": ...}

Data: MNIST's four IDX files, downloaded on the first run into ``$DPOPT_DATA/mnist`` (default
``~/.cache/dpopt/mnist``); offline, put them there yourself.

``dpopt.make_private`` hands back Poisson-sampled batches (in physical batches that fit memory) and an
optimizer whose ``step()`` clips every example's gradient and adds the noise once per sampled batch.
"""

import json

import torch
import torch.nn.functional as F
from torch import nn

import dpopt
from dpopt.data.datasets import load_dataset

EPOCHS, EPSILON, DELTA = 3, 3.0, 1e-5


def per_example_loss(model: nn.Module, batch) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels, reduction="none")


def main() -> None:
    torch.manual_seed(0)
    mnist = load_dataset("mnist", download=True)  # read from disk, downloaded once; (images, labels) tensors
    model = nn.Sequential(  # a Tanh CNN (Papernot et al. 2021); BatchNorm would mix examples, so none
        nn.Conv2d(1, 16, 8, stride=2, padding=3), nn.Tanh(), nn.MaxPool2d(2, 1),
        nn.Conv2d(16, 32, 4, stride=2), nn.Tanh(), nn.MaxPool2d(2, 1),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 32), nn.Tanh(), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=2.0, momentum=0.9)

    model, optimizer, batches = dpopt.make_private(
        model, optimizer, mnist.train, per_example_loss, epsilon=EPSILON, delta=DELTA, epochs=EPOCHS,
        batch_size=1024, physical_batch_size=256, clip=0.1)

    for epoch in range(EPOCHS):
        for batch in batches:
            optimizer.zero_grad()
            per_example_loss(model, batch).mean().backward()
            optimizer.step()

    with torch.no_grad():
        images, labels = mnist.test
        accuracy = (model(images).argmax(1) == labels).float().mean().item()
    print(json.dumps({"epsilon": round(optimizer.epsilon(DELTA), 4), "accuracy": round(accuracy, 4)}))


if __name__ == "__main__":
    main()
