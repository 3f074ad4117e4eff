"""Stage 4 (sum + noise): iid Gaussian noise and correlated noise (tree aggregation, matrix factorizations)
behind one interface; secret randomness (``SecretStream``) vs public (``public_generator``)."""

from dpopt.noise.correlated import CorrelatedNoise, MatrixNoise, TreeNoise
from dpopt.noise.gaussian import GaussianNoise
from dpopt.noise.mechanisms import NOISES, build_noise, factorization
from dpopt.noise.rng import SecretStream, public_generator

__all__ = ["CorrelatedNoise", "GaussianNoise", "MatrixNoise", "NOISES", "SecretStream", "TreeNoise", "build_noise",
           "factorization", "public_generator"]
