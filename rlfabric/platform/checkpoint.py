"""Checkpoints: atomic writes, safe loads.

A checkpoint is written to a temporary file in the same folder, flushed to
disk and renamed over its final name, so a crash mid-write never leaves a
truncated checkpoint behind. Loading uses `torch.load(weights_only=True)`:
a checkpoint can hold tensors and plain containers, never code.

A replay buffer's contents go beside it, in `ckpt_<frames>.replay.npz`,
written by the process that holds the buffer (`runtime.replay_files`), not
through the driver's memory: the driver reserves an empty file for them
(`replay_target`); the buffer's process writes into it if it sees it, else
the driver pulls the contents in chunks into it. The checkpoint names that
file and its size, and is renamed into place only once the file is complete,
so a published checkpoint always has its contents beside it.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from rlfabric.errors import CheckpointError
from rlfabric.runtime.replay_files import CHUNK_BYTES, Pull, copy_from

_NAME = re.compile(r"^ckpt_(\d+)\.pt$")


@contextmanager
def replay_target(folder: Path) -> Iterator[Path]:
    """An empty file in `folder` for a replay buffer's process to write its contents into
    (its unique name proves to that process that it sees this folder); removed on the
    way out unless `save_checkpoint` renamed it into place."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f".replay-{uuid.uuid4().hex}.tmp"
    target.touch()
    try:
        yield target
    finally:
        target.unlink(missing_ok=True)


def replay_file_of(checkpoint: Path) -> Path:
    """Where the replay contents of `checkpoint` go."""
    return checkpoint.with_suffix(".replay.npz")


def save_checkpoint(
    folder: Path,
    state: dict[str, Any],
    env_frames: int,
    keep: int,
    *,
    replay_file: Path | None = None,
    pull: Pull | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> Path:
    """Write `state` as `ckpt_<env_frames>.pt` atomically; keep the newest `keep`.

    A state whose replay contents went to a file (`state["replay"]["contents_file"]`)
    needs the `replay_target` they went to, and `pull` for the contents the buffer's
    process could not write there itself (at most `chunk_bytes` a call).
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"ckpt_{env_frames:013d}.pt"
    contents = state.get("replay", {}).get("contents_file")
    if contents is not None:
        if replay_file is None:
            raise ValueError("the replay contents went to a file: pass replay_file")
        if contents["streamed"]:
            if pull is None:
                raise ValueError("the replay contents wait in their process: pass pull")
            copy_from(pull, str(replay_file), chunk_bytes)
        size = replay_file.stat().st_size
        if size != contents["bytes"]:
            raise CheckpointError(
                f"replay contents {str(replay_file)!r} hold {size} bytes, their writer "
                f"reported {contents['bytes']}"
            )
        os.replace(replay_file, replay_file_of(path))
        contents["file"] = replay_file_of(path).name
    tmp = folder / f".{path.name}.tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # published: the replay contents are complete beside it
    for old in list_checkpoints(folder)[:-keep]:
        old.unlink(missing_ok=True)
    kept = {replay_file_of(p).name for p in list_checkpoints(folder)}
    for sidecar in folder.glob("ckpt_*.replay.npz"):  # also one whose checkpoint never came
        if sidecar.name not in kept:
            sidecar.unlink(missing_ok=True)
    return path


def list_checkpoints(folder: Path) -> list[Path]:
    """Checkpoints in `folder`, oldest first (by the frame count in the name)."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def load_checkpoint(path: Path, replay: bool = True) -> dict[str, Any]:
    """Load a checkpoint; a missing or unreadable file is a CheckpointError naming it.
    With `replay` (to resume; evaluation needs only the weights), so are replay
    contents beside it that are missing or of the wrong size; their absolute path
    goes into the state for the buffer's process to read."""
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
    contents = state.get("replay", {}).get("contents_file")
    if replay and contents is not None:
        file = path.parent / contents["file"]
        if not file.is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} lacks its replay contents {file}")
        if file.stat().st_size != contents["bytes"]:
            raise CheckpointError(
                f"replay contents {str(file)!r} of checkpoint {str(path)!r} hold "
                f"{file.stat().st_size} bytes, not {contents['bytes']}: truncated or replaced"
            )
        contents["path"] = str(file.resolve())
    return state
