"""A checkpoint's replay contents never pass whole through the driver.

The process that holds the buffer (the learner's, or the replay actor's) writes
them beside the checkpoint when it sees the checkpoint folder; otherwise the
driver pulls them in bounded chunks. Either way resume restores them exactly.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from test_replay_feed import _pendulum_feed, _train_on

from rlfabric import Platform
from rlfabric.architectures.replay_actor import RemoteReplayBuffer, replay_contents_served
from rlfabric.architectures.topology import LearnerAndRunners
from rlfabric.errors import CheckpointError
from rlfabric.platform import facade
from rlfabric.platform.checkpoint import (
    load_checkpoint,
    newest_checkpoint,
    replay_file_of,
    replay_target,
    save_checkpoint,
)
from rlfabric.runtime.feeds import ReplayFeed
from rlfabric.runtime.learner import Learner
from rlfabric.runtime.replay import ReplayBuffer

FACTORIES = {"learner": ReplayBuffer.from_spaces, "replay actor": RemoteReplayBuffer.from_spaces}


def _feed(where: str) -> tuple[ReplayFeed, Learner]:
    feed, learner, runner = _pendulum_feed(
        FACTORIES[where], dynamic_buffer=True, buffer_min_capacity=16
    )
    runner.close()
    return feed, learner


def _filled(where: str) -> tuple[ReplayFeed, Learner]:
    """A feed of 80 transitions (the buffer holds its policy actions too)."""
    feed, learner, runner = _pendulum_feed(
        FACTORIES[where], dynamic_buffer=True, buffer_min_capacity=16
    )
    _train_on(feed, learner, runner, 20)
    runner.close()
    return feed, learner


class _Pulls:
    """A pull that records the size of every chunk it hands the driver."""

    def __init__(self, pull):
        self.pull = pull
        self.sizes: list[int] = []

    def __call__(self, offset: int, size: int) -> bytes:
        chunk = self.pull(offset, size)
        self.sizes.append(len(chunk))
        return chunk


@pytest.mark.parametrize("streamed", [False, True], ids=["written by owner", "pulled"])
@pytest.mark.parametrize("where", ["learner", "replay actor"])
def test_replay_contents_go_beside_the_checkpoint_and_come_back_exactly(
    ray_session, tmp_path, where, streamed
):
    feed, learner = _filled(where)
    with replay_target(tmp_path) as target:
        if streamed:  # the buffer's process does not see it: another node, no shared disk
            target.unlink()
        state = {**learner.state_dict(), "replay": feed.state_dict(replay_file=str(target))}
        inline = feed.state_dict()  # the old checkpoint of the same moment: nothing came in
        replay = state["replay"]
        assert replay["contents"] and set(replay["buffer"]) >= {"capacity", "rng"}
        assert "data" not in replay["buffer"] and "count" not in replay["buffer"]
        file = replay["contents_file"]
        assert file["streamed"] == streamed
        assert (file["writer_pid"] == os.getpid()) == (where == "learner")
        pulls = _Pulls(feed.replay_chunk)
        frames = learner.counters["env_frames"]
        path = save_checkpoint(
            tmp_path, state, frames, keep=3, replay_file=target, pull=pulls, chunk_bytes=4096
        )
    if streamed:
        assert pulls.sizes[-1] == 0 and len(pulls.sizes) > 2  # more than one chunk
        assert max(pulls.sizes) <= 4096
    else:
        assert pulls.sizes == []
    sidecar = replay_file_of(path, state["checkpoint_id"])
    assert {p.name for p in tmp_path.iterdir()} == {path.name, sidecar.name}
    with np.load(sidecar) as npz:  # a plain .npz
        np.testing.assert_array_equal(npz["count"], inline["buffer"]["count"].numpy())

    loaded = load_checkpoint(path)
    fresh, fresh_learner = _feed(where)
    fresh_learner.load_state_dict(loaded)
    fresh.load_state_dict(loaded["replay"])
    assert len(fresh.buffer) == len(feed.buffer) == 80
    assert fresh.stored == feed.stored and fresh.owed() == 0
    again = fresh.state_dict()
    assert json.loads(again["buffer"]["rng"]) == json.loads(inline["buffer"]["rng"])
    for key, array in inline["buffer"]["data"].items():
        np.testing.assert_array_equal(again["buffer"]["data"][key].numpy(), array.numpy())
    feed.close()
    fresh.close()


def test_a_buffer_that_does_not_see_the_run_folder_fetches_its_file(ray_session, tmp_path):
    """Resume on a cluster without a shared disk: the file comes from the driver's node."""
    feed, learner = _filled("replay actor")
    with replay_target(tmp_path) as target:
        state = {**learner.state_dict(), "replay": feed.state_dict(replay_file=str(target))}
        path = save_checkpoint(tmp_path, state, 80, keep=3, replay_file=target)
    inline = feed.state_dict()
    fresh, _ = _feed("replay actor")
    with replay_contents_served(load_checkpoint(path), min_nodes=1) as served:
        served["replay"]["contents_file"]["path"] = str(tmp_path / "elsewhere" / "x.npz")
        fresh.load_state_dict(served["replay"])
    again = fresh.state_dict()
    for key, array in inline["buffer"]["data"].items():
        np.testing.assert_array_equal(again["buffer"]["data"][key].numpy(), array.numpy())
    feed.close()
    fresh.close()


def test_a_missing_or_truncated_replay_file_is_named(tmp_path):
    feed, learner = _filled("learner")
    with replay_target(tmp_path) as target:
        state = {**learner.state_dict(), "replay": feed.state_dict(replay_file=str(target))}
        path = save_checkpoint(tmp_path, state, 80, keep=3, replay_file=target)
    sidecar = replay_file_of(path, state["checkpoint_id"])
    data = sidecar.read_bytes()
    sidecar.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=rf"{sidecar.name}.*truncated"):
        load_checkpoint(path)
    sidecar.unlink()
    with pytest.raises(CheckpointError, match=rf"lacks its replay contents .*{sidecar.name}"):
        load_checkpoint(path)
    assert load_checkpoint(path, replay=False)["algorithm"]  # evaluation needs no replay
    # The buffer's process checks it too (the driver's view can be another node's).
    sidecar.write_bytes(data[:-100])
    fresh, _ = _feed("learner")
    contents = {**state["replay"]["contents_file"], "path": str(sidecar)}
    with pytest.raises(CheckpointError, match=rf"{sidecar.name}.*truncated"):
        fresh.load_state_dict({**state["replay"], "contents_file": contents})


def _save(folder: Path, feed: ReplayFeed, learner: Learner, frames: int, keep: int = 3) -> Path:
    with replay_target(folder) as target:
        state = {**learner.state_dict(), "replay": feed.state_dict(replay_file=str(target))}
        return save_checkpoint(folder, state, frames, keep=keep, replay_file=target)


def test_pruning_removes_the_replay_files_of_old_checkpoints(tmp_path):
    feed, learner = _filled("learner")
    orphan = tmp_path / "ckpt_0000000000001-0a1b2c3d4e5f.replay.npz"  # its checkpoint never came
    orphan.write_bytes(b"")
    for frames in (10, 20, 30):
        _save(tmp_path, feed, learner, frames, keep=2)
    checkpoints = ["ckpt_0000000000020.pt", "ckpt_0000000000030.pt"]
    ids = [load_checkpoint(tmp_path / name)["checkpoint_id"] for name in checkpoints]
    assert {p.name for p in tmp_path.iterdir()} == {
        *checkpoints,
        *(f"ckpt_{f:013d}-{i}.replay.npz" for f, i in zip((20, 30), ids, strict=True)),
    }


def test_two_checkpoints_at_one_frame_count_never_share_a_replay_file(tmp_path):
    """A driver that dies between the replay file's rename and the checkpoint's, when
    saving again at the same frame count (a final checkpoint after a periodic one),
    leaves the older checkpoint whole: the new replay file has a name of its own."""
    feed, learner = _filled("learner")
    first = _save(tmp_path, feed, learner, 80)
    first_id = load_checkpoint(first)["checkpoint_id"]
    with replay_target(tmp_path) as target:  # the second save dies before its last rename
        state = {**learner.state_dict(), "replay": feed.state_dict(replay_file=str(target))}
        dies = mock.patch("rlfabric.platform.checkpoint.torch.save", side_effect=KeyboardInterrupt)
        with dies, pytest.raises(KeyboardInterrupt):
            save_checkpoint(tmp_path, state, 80, keep=3, replay_file=target)
    assert len(list(tmp_path.glob("ckpt_*.replay.npz"))) == 2
    assert load_checkpoint(first)["checkpoint_id"] == first_id  # loads whole
    second = _save(tmp_path, feed, learner, 80)  # published: the older files go
    assert {p.name for p in tmp_path.iterdir()} == {
        second.name,
        replay_file_of(second, load_checkpoint(second)["checkpoint_id"]).name,
    }


def test_a_torn_checkpoint_is_skipped_for_the_previous_complete_one(tmp_path, caplog):
    feed, learner = _filled("learner")
    older = _save(tmp_path, feed, learner, 40)
    newer = _save(tmp_path, feed, learner, 80)
    older_id = load_checkpoint(older)["checkpoint_id"]
    newer_file = replay_file_of(newer, load_checkpoint(newer)["checkpoint_id"])
    # Of another id: the newer checkpoint's replay file replaced by one under the older id.
    newer_file.rename(replay_file_of(newer, older_id))
    with pytest.raises(CheckpointError, match=r"lacks its replay contents"):
        load_checkpoint(newer)
    with caplog.at_level(logging.WARNING, logger="rlfabric"):
        path, state = newest_checkpoint(tmp_path)
    assert path == older and state["checkpoint_id"] == older_id
    assert f"skipping checkpoint {newer.name}" in caplog.text
    # A checkpoint that names a file of another id is refused, not paired with it.
    tampered = load_checkpoint(newer, replay=False)
    tampered["replay"]["contents_file"]["file"] = replay_file_of(newer, older_id).name
    torch.save(tampered, newer)
    with pytest.raises(CheckpointError, match=r"of another id"):
        load_checkpoint(newer)
    # One file of the pair missing: the same.
    replay_file_of(newer, older_id).unlink()
    assert newest_checkpoint(tmp_path)[0] == older
    assert newest_checkpoint(tmp_path, replay=False)[0] == newer  # evaluation needs no replay
    for path in tmp_path.glob("ckpt_*.replay.npz"):
        path.unlink()
    with pytest.raises(CheckpointError, match=r"no checkpoint .* loads whole"):
        newest_checkpoint(tmp_path)


@contextmanager
def _unseen_target(folder: Path):
    """A target the buffer's process cannot see, as on a node without the run folder."""
    with replay_target(folder) as target:
        target.unlink()
        yield target


def test_a_run_pulls_replay_contents_it_cannot_write_and_resumes_from_them(
    ray_session, tmp_path, monkeypatch
):
    """The whole path: learner actor -> replay actor -> chunks -> driver -> resume."""
    pulls: list[int] = []
    original = LearnerAndRunners.replay_chunk

    def recorded(self, offset: int, size: int) -> bytes:
        chunk = original(self, offset, size)
        pulls.append(len(chunk))
        return chunk

    monkeypatch.setattr(LearnerAndRunners, "replay_chunk", recorded)
    monkeypatch.setattr(facade, "replay_target", _unseen_target)
    monkeypatch.setattr(
        facade, "save_checkpoint", functools.partial(save_checkpoint, chunk_bytes=8192)
    )
    # Updates are not what this checks: warm-up for most of the run keeps them few.
    algo = {"name": "sac", "hidden": [32], "warmup_steps": 800, "batch_size": 64}
    run = {"stop": {"env_frames": 1_000}, "display": "none", "logdir": str(tmp_path)}
    first = Platform(
        arch="seed",
        algo=algo,
        env={"id": "Pendulum-v1", "num_envs": 2},
        resources={"replay_actor": True},
        run={**run, "name": "pulled"},
    ).fit()
    assert len(pulls) > 2 and max(pulls) <= 8192
    state = load_checkpoint(Path(first.checkpoint))
    assert state["replay"]["contents_file"]["streamed"]
    with np.load(state["replay"]["contents_file"]["path"]) as npz:
        assert npz["count"].sum() == first.metrics["replay_size"]
    monkeypatch.undo()
    second = Platform.resume(first.logdir, ["run.stop.env_frames=1200"]).fit()
    lines = (Path(second.logdir) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    resumed = [r for r in records if r["env_frames"] > first.metrics["env_frames"]]
    assert resumed and resumed[0]["replay_size"] > first.metrics["replay_size"]
