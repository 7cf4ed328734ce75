"""Checkpoints: atomic writes, safe loads.

A checkpoint is written to a temporary file in the same folder, flushed to
disk and renamed over its final name, so a crash mid-write never leaves a
truncated checkpoint behind. Loading uses `torch.load(weights_only=True)`:
a checkpoint can hold tensors and plain containers, never code.

A replay buffer's contents go beside it, in `ckpt_<frames>-<id>.replay.npz`,
written by the process that holds the buffer (`runtime.replay_files`), not
through the driver's memory: the driver reserves an empty file for them
(`replay_target`); the buffer's process writes into it if it sees it, else
the driver pulls the contents in chunks into it. The checkpoint names that
file and its size, and is renamed into place only once the file is complete,
so a published checkpoint always has its contents beside it.

Each checkpoint has an id, in its state and in its replay file's name, that
the loader checks: two checkpoints at the same frame count (a final one
after a periodic one) never share a replay file, so a driver that dies
between the two renames leaves the older checkpoint whole. A checkpoint that
is torn anyway (a file missing, truncated or of another id) is skipped for
the previous complete one (`newest_checkpoint`), with a warning.
"""

from __future__ import annotations

import logging
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
_REPLAY_NAME = re.compile(r"^ckpt_(\d+)(?:-([0-9a-f]+))?\.replay\.npz$")

log = logging.getLogger(__name__)


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


def replay_file_of(checkpoint: Path, checkpoint_id: str) -> Path:
    """Where the replay contents of `checkpoint` (of id `checkpoint_id`) go."""
    return checkpoint.with_name(f"{checkpoint.stem}-{checkpoint_id}.replay.npz")


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
    """Write `state` as `ckpt_<env_frames>.pt` atomically under a new id (in
    `state["checkpoint_id"]`); keep the newest `keep`.

    A state whose replay contents went to a file (`state["replay"]["contents_file"]`)
    needs the `replay_target` they went to, and `pull` for the contents the buffer's
    process could not write there itself (at most `chunk_bytes` a call).
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"ckpt_{env_frames:013d}.pt"
    state["checkpoint_id"] = checkpoint_id = uuid.uuid4().hex[:12]
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
        os.replace(replay_file, replay_file_of(path, checkpoint_id))
        contents["file"] = replay_file_of(path, checkpoint_id).name
    tmp = folder / f".{path.name}.tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # published: the replay contents are complete beside it
    for old in list_checkpoints(folder)[:-keep]:
        old.unlink(missing_ok=True)
    # Replay files of checkpoints gone, or whose checkpoint never came; at this frame
    # count only the one just published is referenced (an older checkpoint here was
    # replaced). Read from names: loading every kept checkpoint to ask would cost more.
    kept = {_frames(p) for p in list_checkpoints(folder)}
    for sidecar in folder.glob("ckpt_*.replay.npz"):
        match = _REPLAY_NAME.match(sidecar.name)
        if match is None:
            continue
        frames, owner = int(match.group(1)), match.group(2)
        if frames not in kept or (frames == env_frames and owner != checkpoint_id):
            sidecar.unlink(missing_ok=True)
    return path


def _frames(checkpoint: Path) -> int:
    match = _NAME.match(checkpoint.name)
    assert match is not None, checkpoint
    return int(match.group(1))


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
        checkpoint_id = state.get("checkpoint_id")  # absent in checkpoints before ids
        if checkpoint_id is not None and file.name != replay_file_of(path, checkpoint_id).name:
            raise CheckpointError(
                f"checkpoint {str(path)!r} (id {checkpoint_id}) names replay contents "
                f"{file.name!r} of another id"
            )
        if not file.is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} lacks its replay contents {file}")
        if file.stat().st_size != contents["bytes"]:
            raise CheckpointError(
                f"replay contents {str(file)!r} of checkpoint {str(path)!r} hold "
                f"{file.stat().st_size} bytes, not {contents['bytes']}: truncated or replaced"
            )
        contents["path"] = str(file.resolve())
    return state


def newest_checkpoint(folder: Path, replay: bool = True) -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint in `folder` that loads whole, and its state.

    A torn one (a file missing, truncated or of another id: a disk that filled, a
    copy interrupted) is skipped for the previous one, with a warning naming why.
    """
    checkpoints = list_checkpoints(folder)
    reasons = []
    for path in reversed(checkpoints):
        try:
            state = load_checkpoint(path, replay)
        except CheckpointError as err:
            log.warning("skipping checkpoint %s: %s", path.name, err)
            reasons.append(str(err))
            continue
        if reasons:
            log.warning("resuming from %s, the newest complete checkpoint", path.name)
        return path, state
    if not checkpoints:
        raise CheckpointError(f"{str(folder)!r} holds no checkpoint")
    raise CheckpointError(f"no checkpoint in {str(folder)!r} loads whole: {'; '.join(reasons)}")
