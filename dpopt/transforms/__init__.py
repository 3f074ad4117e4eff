"""Stage 5: post-processing of the privatized gradient (free under DP)."""

from dpopt.transforms.base import Transform
from dpopt.transforms.kalman import KalmanFilter
from dpopt.transforms.nesterov import AcceleratedSRG
from dpopt.transforms.srg import RecursiveGradient

__all__ = ["AcceleratedSRG", "KalmanFilter", "RecursiveGradient", "Transform"]
