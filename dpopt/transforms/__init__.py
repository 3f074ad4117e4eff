"""Stage 5: post-processing of the privatized gradient (free under DP)."""

from dpopt.transforms.base import Transform
from dpopt.transforms.kalman import KalmanFilter

__all__ = ["KalmanFilter", "Transform"]
