"""End to end: SAC and TD3 through the replay path of every architecture; sparse training."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from test_training import FAST_VTRACE, SHARED_TORSO

from rlfabric import Platform
from rlfabric.platform.checkpoint import load_checkpoint
from rlfabric.platform.evaluate import evaluate, load_policy

#: Pendulum settings that learn within seconds (the default-settings runs:
#: docs/experiments/off-policy.md).
FAST = {"hidden": [64, 64], "lr": 1e-3, "warmup_steps": 1000}
PENDULUM = {"id": "Pendulum-v1", "num_envs": 2}


def _fit(tmp_path: Path, arch: str, algo: dict, steps: int, **sections):
    run = {"stop": {"env_frames": steps}, "display": "none", "logdir": str(tmp_path)}
    run.update(sections.pop("run", {}))
    return Platform(arch=arch, algo=algo, env=PENDULUM, run=run, **sections).fit()


def _records(result) -> list[dict]:
    lines = (Path(result.logdir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_seed_learns_pendulum(tmp_path, ray_session):
    """SAC under SEED until the greedy policy swings up: a periodic evaluation on fresh
    episodes (5, every 3 s) ends the run at a mean of -400 (random play: -1230).

    Three runs here stopped at 3.3k-3.8k steps. The policy checked at a fixed step count
    instead (8k) failed once in two full suites at -717, two of its five episodes near
    -1,500; that run's records were not kept, so whether it learned late or fell back after
    learning is not known. Stopping at the first good evaluation makes the check depend on
    neither. The 15k-step budget is four times what the runs needed.

    SAC only: TD3 shares this replay path (its own learning is tests/test_sac_td3.py's, its
    runs under impala and ga3c are below).
    """
    stop = {"env_frames": 15_000, "eval_return_mean": -400.0}
    run = {"stop": stop, "eval_interval_s": 3.0, "eval_episodes": 5}
    result = _fit(tmp_path, "seed", {"name": "sac", **FAST}, 15_000, run=run)
    m = result.metrics
    assert m["eval_return_mean"] >= -400.0, m  # random play: -1230
    # One update per stored transition after the warm-up, within one unroll per group.
    assert m["updates"] <= m["replay_stored"] - 1000
    assert m["updates"] >= m["replay_stored"] - 1000 - 3 * 8  # see the impala/ga3c test
    assert m["replay_size"] == m["replay_stored"]
    # The training window still holds the random warm-up; the greedy policy is far better.
    assert m["episode_return_mean"] < m["eval_return_mean"]


@pytest.mark.parametrize("arch", ["impala", "ga3c"])
def test_sparse_replay_runs_under_impala_and_ga3c(tmp_path, ray_session, arch):
    """RLx2 under both: the ratio holds, and the checkpointed networks are exactly sparse."""
    algo = {"name": "td3", **FAST, "warmup_steps": 300, "updates_per_step": 0.5}
    sparse = {"actor": 0.9, "critic": 0.85, "delta": 50}  # topology updates every 50 steps
    result = _fit(tmp_path, arch, algo, 1_500, sparse=sparse)
    m = result.metrics
    assert m["env_frames"] >= 1_500
    owed = (m["replay_stored"] - 300) * 0.5
    # Ratio kept: trainers are at most one unroll (4 updates) behind, plus one update in
    # flight, plus an unroll stored between the two reads of this metrics snapshot.
    assert owed - 2 * 8 <= m["updates"] <= owed
    assert "critic_loss" in {k for r in _records(result) for k in r}
    assert m["sparsity_actor"] == pytest.approx(0.9, abs=0.005)
    assert m["sparsity_critic"] == pytest.approx(0.85, abs=0.005)
    assert m["inference_flops_fraction"] < 0.2 and m["train_flops_fraction"] < 0.3
    state = load_checkpoint(Path(result.checkpoint))["algorithm"]
    masks = state["sparse"]["actor"]["masks"]
    weights = state["networks"]["actor"]
    # 600 updates, one actor step in two (TD3's delay): three topology updates or more.
    assert state["sparse"]["actor"]["step_count"] > 150
    for name, mask in masks.items():
        weight = weights[f"{name}.weight"]
        assert not weight[~mask].any(), name  # dropped connections are exactly zero


def test_replay_buffer_in_its_own_actor(tmp_path, ray_session):
    # Warm-up for most of the run: each update samples through the actor (a remote call),
    # and a few hundred of them show the ratio as well as a thousand.
    algo = {"name": "sac", **FAST, "warmup_steps": 600, "batch_size": 64}
    result = _fit(tmp_path, "seed", algo, 1_000, resources={"replay_actor": True})
    m = result.metrics
    assert m["replay_size"] == m["replay_stored"] >= 1_000 - 4 * 8
    assert m["replay_stored"] - 600 - 3 * 8 <= m["updates"] <= m["replay_stored"] - 600
    assert m["updates"] > 0
    # The final checkpoint and the last record are one moment (taken under the learner's
    # locks together), although runners go on adding until they are stopped.
    checkpoint = load_checkpoint(Path(result.checkpoint))
    state = checkpoint["replay"]
    # The replay actor wrote its contents beside the checkpoint; none came to the driver.
    assert state["contents"] and "data" not in state["buffer"]
    assert not state["contents_file"]["streamed"]
    assert state["contents_file"]["writer_pid"] != os.getpid()
    with np.load(state["contents_file"]["path"]) as contents:
        assert contents["count"].sum() == m["replay_size"]
    assert checkpoint["counters"]["env_frames"] == m["env_frames"]
    assert checkpoint["counters"]["updates"] == m["updates"]


def test_local_resume_keeps_the_replay_buffer(tmp_path):
    algo = {"name": "sac", **FAST, "warmup_steps": 200, "batch_size": 64}
    first = _fit(tmp_path, "local", algo, 1_000, run={"name": "resumable"})
    state = load_checkpoint(Path(first.checkpoint))
    assert state["replay"]["contents"] and state["replay"]["contents_file"]["bytes"] > 0
    assert state["replay"]["stored"] == first.metrics["replay_stored"]
    second = Platform.resume(first.logdir, ["run.stop.env_frames=1600"]).fit()
    records = _records(second)
    resumed = [r for r in records if r["env_frames"] > first.metrics["env_frames"]]
    assert resumed and resumed[0]["replay_size"] > first.metrics["replay_size"]
    assert second.metrics["updates"] > first.metrics["updates"]
    # Partial unrolls (up to 8 steps per group) are lost at the save and pending at the end.
    assert second.metrics["replay_stored"] >= 1_600 - 4 * 8


def test_sparsity_wraps_an_on_policy_model_too(tmp_path):
    """V-trace's shared actor-critic at 90% sparsity, RigL updates every 50 steps, learns."""
    run = {"stop": {"env_frames": 150_000}, "display": "none", "logdir": str(tmp_path)}
    result = Platform(
        arch="local",
        algo=FAST_VTRACE,
        model=SHARED_TORSO,
        env={"id": "CartPole-v1", "num_envs": 64},
        sparse={"actor": 0.9, "delta": 50},
        run=run,
    ).fit()
    m = result.metrics
    assert m["sparsity_actor"] == pytest.approx(0.9, abs=0.001)
    assert m["inference_flops_fraction"] == pytest.approx(0.1, abs=0.01)
    assert m["episode_return_mean"] > 3 * 22.0  # random CartPole: 22


def test_td3_ou_exploration_is_carried_in_impala_actors(tmp_path, ray_session):
    """The per-env noise lives in the actors under IMPALA (with inference under SEED and
    GA3C, the same `RecurrentStates`: tests/test_sac_td3.py), carried from step to step:
    within Pendulum's 200-step episodes it wanders far from mu(s), where independent draws
    of the same sigma * sqrt(dt) would stay near it."""
    algo = {"name": "td3", **FAST, "warmup_steps": 300, "exploration": "ou"}
    # dynamic_buffer stores mu(s) beside each action (RLx2's policy distance).
    algo |= {"exploration_noise": 0.5, "dynamic_buffer": True, "buffer_check_every": 10**6}
    result = _fit(tmp_path, "impala", algo, 1_200)
    replay = load_checkpoint(Path(result.checkpoint))["replay"]
    with np.load(replay["contents_file"]["path"]) as contents:
        stored = contents["count"]
        noise = np.concatenate(
            [
                (contents["action"] - contents["policy_action"])[env, :n]
                for env, n in enumerate(stored)
            ]
        )
    # RMS noise in env units (half range 2): about 0.85 carried (0.75 of the steps after the
    # warm-up, OU from 0 at each episode start); 0.09 if each step started from 0.
    rms = float(np.sqrt(np.mean(noise**2)))
    assert rms > 0.3, rms
    _, policy = load_policy(result.logdir)  # the greedy policy carries no noise state
    assert evaluate(policy, Platform(env=PENDULUM).spec.env, episodes=1).returns
