"""Stage 4 (sum + noise): iid Gaussian noise on the clipped sum."""

from __future__ import annotations

import torch

from dpopt.noise.rng import SecretStream
from dpopt.privacy.ledger import GaussianRelease, Participation


class GaussianNoise:
    """Adds N(0, (noise_multiplier * sensitivity)^2 I) to a list of tensors, from a secret stream.

    :param noise_multiplier: the noise's std over the sensitivity, z (>= 0; ``noise_multiplier_for`` gives the z
        of a target epsilon; 0 is no noise and no privacy).
    :param sensitivity: the L2 bound of one example's contribution to the sum (the clip bound C).
    :param stream: the secret stream the noise comes from (``SecretStream(key, "noise")``).
    :raises ValueError: for a negative noise multiplier.
    """

    def __init__(self, noise_multiplier: float, sensitivity: float, stream: SecretStream) -> None:
        if noise_multiplier < 0:
            raise ValueError(f"noise multiplier must be >= 0, got {noise_multiplier}")
        self.noise_multiplier = float(noise_multiplier)
        self.sensitivity = float(sensitivity)
        self.stream = stream

    def release(self, participation: Participation) -> GaussianRelease:
        """What one call releases, for the ledger."""
        return GaussianRelease(self.noise_multiplier, participation)

    @property
    def std(self) -> float:
        """The noise's standard deviation: ``noise_multiplier * sensitivity``."""
        return self.noise_multiplier * self.sensitivity

    def __call__(self, sums: list[torch.Tensor], step: int) -> list[torch.Tensor]:
        """Adds the noise to ``sums`` in place (no model-sized temporary) and returns them."""
        if self.std == 0.0 or not sums:
            return sums
        return self.stream.add_normal_(sums, step, self.std)
