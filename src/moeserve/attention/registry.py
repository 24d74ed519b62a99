"""Attention backends by name, chosen once at start-up (``reference`` everywhere, ``triton`` on GPUs)."""

from __future__ import annotations

from moeserve.attention.backend import AttentionBackend


def get_backend(name: str) -> AttentionBackend:
    if name == "reference":
        from moeserve.attention.reference import ReferenceMLABackend

        return ReferenceMLABackend()
    if name == "triton":
        from moeserve.attention.triton_mla import TritonMLABackend

        return TritonMLABackend()
    raise ValueError(f"unknown attention backend {name!r} (available: reference, triton)")
