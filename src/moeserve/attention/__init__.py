"""Attention backends: the model calls MLA attention through this small interface."""

from moeserve.attention.backend import AttentionBackend, MLAWeights
from moeserve.attention.registry import get_backend

__all__ = ["AttentionBackend", "MLAWeights", "get_backend"]
