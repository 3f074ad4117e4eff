"""Stage 5: post-processing of the privatized gradient. Free under DP: it sees only released values."""

from __future__ import annotations

from typing import Any

import torch


class Transform:
    """Post-processing of the privatized gradient; carries its own state. A transform may also watch the
    base update: ``before_update``/``after_update`` receive the parameters around it."""

    def __call__(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        return grads

    def before_update(self, params: list[torch.Tensor]) -> None:
        pass

    def after_update(self, params: list[torch.Tensor]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
