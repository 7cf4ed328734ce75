"""Checkpoints: atomic writes, safe loads.

A checkpoint is written to a temporary file in the same folder, flushed to
disk and renamed over its final name, so a crash mid-write never leaves a
truncated checkpoint behind. Loading uses `torch.load(weights_only=True)`:
a checkpoint can hold tensors and plain containers, never code.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from rlfabric.errors import CheckpointError

_NAME = re.compile(r"^ckpt_(\d+)\.pt$")


def save_checkpoint(folder: Path, state: dict[str, Any], env_frames: int, keep: int) -> Path:
    """Write `state` as `ckpt_<env_frames>.pt` atomically; keep the newest `keep`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"ckpt_{env_frames:013d}.pt"
    tmp = folder / f".{path.name}.tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    for old in list_checkpoints(folder)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def list_checkpoints(folder: Path) -> list[Path]:
    """Checkpoints in `folder`, oldest first (by the frame count in the name)."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint; a missing or unreadable file is a CheckpointError naming it."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(
            f"checkpoint {str(path)!r} cannot be read ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else 'no detail'}); it may be truncated or "
            "not an rlfabric checkpoint"
        ) from err
    if not isinstance(state, dict) or "algorithm" not in state or "counters" not in state:
        raise CheckpointError(f"{str(path)!r} is not an rlfabric checkpoint")
    return state
