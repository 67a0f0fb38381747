"""One device policy for every command: ``auto`` (the default everywhere) means CUDA when a GPU is
visible, else the CPU; ``cuda`` without a visible GPU is a clear error, not a silent fallback."""

from __future__ import annotations

from typing import Literal

Device = Literal["auto", "cpu", "cuda"]
DEVICES: tuple[Device, ...] = ("auto", "cpu", "cuda")


def resolve_device(setting: str, name: str = "device") -> str:
    """``cpu`` or ``cuda`` for a ``--device`` / ``ICR_DEVICE`` / ``train.device`` setting; ``name``
    is how the error message calls the setting."""
    if setting not in DEVICES:
        raise ValueError(f"{name} must be one of {', '.join(DEVICES)}, got {setting!r}")
    import torch  # noqa: PLC0415 (torch takes seconds to import)

    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name}=cuda but no CUDA device is visible; use {name}=cpu or auto")
    return setting
