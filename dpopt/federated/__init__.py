"""Federated learning with local DP: Clip-SGD, Clip21-SGD and Clip21-SGD2M (spec clip21_sgd2m.md)."""
