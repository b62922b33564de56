"""Choosing the torch device: ``auto`` means CUDA when available, else CPU."""

from __future__ import annotations


def resolve_device(name: str = "auto") -> str:
    """``auto`` -> ``cuda`` if a GPU is visible, else ``cpu``; other names pass through."""
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def device_type(name: str = "auto") -> str:
    return resolve_device(name).split(":")[0]
