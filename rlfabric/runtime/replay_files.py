"""The replay buffer's contents as a file beside a checkpoint, written where the buffer is.

A replay buffer can hold a GiB. Shipped inside the learner's checkpoint state
it crossed the object store and sat whole in the driver's memory.
Instead the process that holds the buffer writes its contents itself, as an
`.npz` (one `.npy` member per field, stored, not compressed: numpy reads it
with `np.load`, and zip's CRC-32 per member catches a damaged file):

- into the checkpoint folder, when it sees there the empty file the driver
  reserved for it (a name no other node has: seeing it proves one filesystem);
- else into a local temporary file (the `Outbox`), which the driver pulls in
  chunks of at most `CHUNK_BYTES` and writes into the checkpoint folder itself.

Arrays are written and read a stream's row at a time, as views of the
buffer's own memory: neither side makes a copy of the contents.
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from typing import IO, Any

import numpy as np

from rlfabric.errors import CheckpointError

#: The most bytes of contents one pull moves from the buffer's process to the driver.
CHUNK_BYTES = 8 * 2**20

#: Hands out up to `size` bytes of a file from `offset`, b"" at its end, from another process.
Pull = Callable[[int, int], bytes]


class Outbox:
    """Where the process holding a buffer writes its contents for a checkpoint."""

    def __init__(self) -> None:
        self.path: str | None = None  # a local file waiting to be pulled

    def save(self, write: Callable[[IO[bytes]], None], target: str) -> dict[str, Any]:
        """Write with `write` into `target` if this process sees it, else into a local file
        for `read` to hand out; flushed to disk either way. Returns what the checkpoint
        records: `bytes`, `writer_pid` and `streamed` (whether the driver must pull it)."""
        self.close()  # a pull the driver never finished
        reachable = os.path.isfile(target) and os.access(target, os.W_OK)
        path = target
        if not reachable:
            fd, path = tempfile.mkstemp(prefix="rlfabric-replay-", suffix=".npz")
            os.close(fd)
            self.path = path
        with open(path, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            nbytes = os.fstat(f.fileno()).st_size
        return {"bytes": nbytes, "writer_pid": os.getpid(), "streamed": not reachable}

    def read(self, offset: int, size: int) -> bytes:
        """Up to `size` bytes of the waiting file from `offset`; b"" at its end, which
        also removes it."""
        if self.path is None:
            raise RuntimeError("no replay contents are waiting to be pulled")
        with open(self.path, "rb") as f:
            f.seek(offset)
            chunk = f.read(min(size, CHUNK_BYTES))
        if not chunk:
            self.close()
        return chunk

    def close(self) -> None:
        if self.path is not None:
            os.unlink(self.path)
            self.path = None


def copy_from(pull: Pull, path: str, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Write the bytes `pull(offset, size)` hands out, to its b"", into `path`, one chunk
    in memory at a time; flushed to disk."""
    offset = 0
    with open(path, "wb") as f:
        while chunk := pull(offset, chunk_bytes):
            f.write(chunk)
            offset += len(chunk)
        f.flush()
        os.fsync(f.fileno())


Member = tuple[tuple[int, ...], np.dtype, Iterable[np.ndarray]]


def write_npz(file: IO[bytes], members: dict[str, Member]) -> None:
    """An `.npz` whose member `name` has the given shape and dtype and the bytes of the
    C-contiguous pieces, in order (they must add up to the shape)."""
    with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, (shape, dtype, pieces) in members.items():
            with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                header = {
                    "descr": np.lib.format.dtype_to_descr(dtype),
                    "fortran_order": False,
                    "shape": shape,
                }
                np.lib.format.write_array_header_2_0(f, header)
                for piece in pieces:
                    f.write(np.ascontiguousarray(piece, dtype).data)


Pieces = Callable[[str, tuple[int, ...], np.dtype], Iterable[np.ndarray]]


def read_npz(path: str, nbytes: int, pieces: Pieces) -> None:
    """Read each member of the `.npz` at `path` into the C-contiguous arrays that
    `pieces(name, shape, dtype)` returns for it (raising ValueError if it does not fit).

    A file that is missing or not `nbytes` long (a truncated copy), or whose
    members do not read back whole with their CRC-32, is a CheckpointError naming it.
    """
    if not os.path.isfile(path):
        raise CheckpointError(
            f"replay contents {path!r} do not exist (as seen by pid {os.getpid()}, the "
            "process holding the replay buffer)"
        )
    size = os.path.getsize(path)
    if size != nbytes:
        raise CheckpointError(
            f"replay contents {path!r} hold {size} bytes where the checkpoint says {nbytes}: "
            "the file is truncated or from another checkpoint"
        )
    try:
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                with zf.open(info) as f:
                    version = np.lib.format.read_magic(f)
                    read_header = (
                        np.lib.format.read_array_header_1_0
                        if version == (1, 0)
                        else np.lib.format.read_array_header_2_0
                    )
                    shape, fortran_order, dtype = read_header(f)
                    name = info.filename.removesuffix(".npy")
                    if fortran_order:
                        raise ValueError(f"member {name!r} is in Fortran order")
                    for out in pieces(name, shape, dtype):
                        _read_into(f, out)
                    if f.read():  # also: zipfile checks the CRC-32 at the end
                        raise ValueError(f"member {name!r} is longer than its shape")
    except (zipfile.BadZipFile, ValueError, EOFError) as err:
        raise CheckpointError(f"replay contents {path!r} cannot be read: {err}") from err


def _read_into(f: IO[bytes], out: np.ndarray) -> None:
    """Fill the C-contiguous `out` from `f`, `CHUNK_BYTES` at a time."""
    if not out.flags.c_contiguous:
        raise ValueError("read_npz reads into C-contiguous arrays only")
    view = memoryview(out.reshape(-1).view(np.uint8))
    for start in range(0, len(view), CHUNK_BYTES):
        block = view[start : start + CHUNK_BYTES]
        if f.readinto(block) != len(block):
            raise EOFError("a member ends early")
