"""End to end: runs that learn, write every artifact, resume, and survive a runner crash."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rlfabric import Platform
from rlfabric.platform.checkpoint import list_checkpoints, load_checkpoint

#: CartPole settings that learn within a small budget (the full runs:
#: docs/experiments/classic-control.md).
FAST_VTRACE = {
    "name": "vtrace",
    "optimizer": "adam",
    "lr": 3e-3,
    "eps": 1e-5,
    "loss_reduction": "mean",
    "lr_schedule": "constant",
    "batch_size": 8,
    "unroll_length": 10,
}
FAST_VTRACE_T = 10
#: FAST_VTRACE's lr is one for a torso shared by policy and value. The classic preset
#: separates them under seed and local (at lr 1e-3), where this lr collapses the policy in
#: about 4 seeds of 10; the tests that assert learning keep the shared torso.
SHARED_TORSO = {"shared_torso": True}
RANDOM_CARTPOLE_RETURN = 22.0  # mean return of the uniform random policy


def _fit(tmp_path: Path, arch: str | dict, frames: int | None, **sections):
    sections.setdefault("algo", FAST_VTRACE)
    sections.setdefault("model", SHARED_TORSO)
    sections.setdefault("env", {"id": "CartPole-v1", "num_envs": 64})
    run = {"stop": {"env_frames": frames}, "display": "none", "logdir": str(tmp_path)}
    run.update(sections.pop("run", {}))
    return Platform(arch=arch, run=run, **sections).fit()


def _assert_artifacts(result) -> list[dict]:
    logdir = Path(result.logdir)
    assert (logdir / "spec.yaml").is_file()
    assert (logdir / "curve.png").stat().st_size > 1000
    assert list((logdir / "tensorboard").glob("events.out.tfevents.*"))
    assert Path(result.checkpoint).is_file()
    assert Path(result.checkpoint).parent == logdir / "checkpoints"
    records = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    assert records
    last = records[-1]
    for key in ("env_frames", "agent_steps", "wall_time_s", "episode_return_mean"):
        assert key in last, key
    for key in ("env_frames_per_s", "loss", "pg_loss", "baseline_loss", "entropy"):
        assert any(key in r for r in records), key  # per update: not in every interval
    frames = [r["env_frames"] for r in records]
    assert frames == sorted(frames)
    return records


def test_local_learns_cartpole_and_writes_every_artifact(tmp_path):
    result = _fit(tmp_path, "local", 150_000)
    _assert_artifacts(result)
    assert result.metrics["env_frames"] >= 150_000
    assert result.metrics["episode_return_mean"] > 3 * RANDOM_CARTPOLE_RETURN
    assert result.stop_reason.startswith("env_frames")


def test_local_is_deterministic_for_a_seed(tmp_path):
    first = _fit(tmp_path / "a", "local", 20_000)
    second = _fit(tmp_path / "b", "local", 20_000)
    w1 = load_checkpoint(Path(first.checkpoint))["algorithm"]["model"]
    w2 = load_checkpoint(Path(second.checkpoint))["algorithm"]["model"]
    assert first.metrics["env_frames"] == second.metrics["env_frames"]
    for key in w1:
        assert torch.equal(w1[key], w2[key]), key


def test_resume_continues_at_the_saved_frame_count(tmp_path):
    first = _fit(tmp_path, "local", 30_000)
    saved = load_checkpoint(Path(first.checkpoint))
    saved_frames = saved["counters"]["env_frames"]
    records_before = len((Path(first.logdir) / "metrics.jsonl").read_text().splitlines())
    overrides = ["run.stop.env_frames=60000", "run.report_interval_s=0.05"]
    resumed = Platform.resume(first.logdir, overrides)
    assert resumed.spec.run.stop.env_frames == 60_000
    result = resumed.fit()
    assert result.logdir == first.logdir
    lines = (Path(first.logdir) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines]
    after = records[records_before:]
    assert after and after[0]["env_frames"] > saved_frames
    assert after[0]["env_frames"] < saved_frames + 30_000
    assert after[0]["wall_time_s"] > records[records_before - 1]["wall_time_s"]
    assert result.metrics["env_frames"] >= 60_000
    assert result.metrics["updates"] > saved["counters"]["updates"]
    assert len(list_checkpoints(Path(first.logdir) / "checkpoints")) >= 2


def test_resume_keeps_the_first_target_hit(tmp_path):
    run = {"return_window": 10, "stop": {"episode_return_mean": 40, "env_frames": 200_000}}
    first = _fit(tmp_path, "local", 200_000, run=run)
    assert first.stop_reason.startswith("episode_return_mean")
    hit = (first.target.env_frames, first.target.wall_time_s)
    assert hit[0] is not None
    resumed = Platform.resume(first.logdir, ["run.stop.env_frames=" + str(hit[0] + 5_000)])
    result = resumed.fit()
    assert (result.target.env_frames, result.target.wall_time_s) == hit
    # A resume with another target does not take the old target's hit.
    other = Platform.resume(first.logdir, ["run.stop.episode_return_mean=1000"])
    other.spec.run.stop.env_frames = int(result.metrics["env_frames"]) + 1_000
    assert other.fit().target.env_frames is None


def test_resume_restores_weights_optimizer_and_rng(tmp_path):
    from rlfabric.architectures.local import LocalArchitecture

    first = _fit(tmp_path, "local", 10_000)
    state = load_checkpoint(Path(first.checkpoint))
    platform = Platform.resume(first.logdir)
    arch = LocalArchitecture(platform.spec, platform.env_info, platform.spec.run.stop)
    arch.start(state)
    restored = arch.get_state()
    for key, value in state["algorithm"]["model"].items():
        assert torch.equal(restored["algorithm"]["model"][key], value)
    assert restored["counters"] == state["counters"]
    assert torch.equal(restored["rng"]["torch"], state["rng"]["torch"])
    opt = restored["algorithm"]["optimizer"]["state"]
    assert all(
        torch.equal(opt[k]["exp_avg"], v["exp_avg"])
        for k, v in state["algorithm"]["optimizer"]["state"].items()
    )
    arch.stop()


def test_seed_learns_cartpole_and_writes_every_artifact(ray_session, tmp_path):
    stop = {"env_frames": 150_000, "episode_return_mean": 3 * RANDOM_CARTPOLE_RETURN}
    result = _fit(tmp_path, "seed", 150_000, run={"stop": stop})
    records = _assert_artifacts(result)
    assert result.stop_reason.startswith("episode_return_mean"), result.metrics
    for key in (
        "inference_batch_envs",
        "inference_ms",
        "env_step_ms",
        "learner_step_ms",
        "batch_queue",
        "policy_lag",
    ):
        assert any(key in r for r in records), key
    assert result.metrics["dropped_unrolls"] == 0


def test_seed_replaces_a_crashed_env_runner(ray_session, tmp_path):
    from rlfabric.architectures.seed import SeedArchitecture

    platform = Platform(
        arch="seed",
        algo=FAST_VTRACE,
        env={"id": "CartPole-v1", "num_envs": 16},
        resources={"num_env_runners": 2},
        run={"report_interval_s": 0.5, "logdir": str(tmp_path)},
    )
    arch = SeedArchitecture(platform.spec, platform.env_info, platform.spec.run.stop)
    try:  # a start that fails half-way leaves actors for stop() to end
        arch.start()
        before = arch.step()
        ray_session.kill(arch.runners.runners[0], no_restart=True)
        metrics = arch.step()
        for _ in range(10):
            if metrics["runner_restarts"] >= 1:
                break
            metrics = arch.step()
        assert metrics["runner_restarts"] == 1
        later = arch.step()
        later = arch.step()
        assert later["env_frames"] > metrics["env_frames"] > before["env_frames"]
        assert later["updates"] > before["updates"]
    finally:
        arch.stop()


@pytest.mark.parametrize(
    ("env", "arch", "model"),
    [
        ("ALE/Pong-v5", "seed", {}),
        ("ALE/Pong-v5", "seed", {"lstm": 32}),
        ("InvertedPendulum-v5", "seed", {}),
        pytest.param("ALE/Pong-v5", "local", {}, marks=pytest.mark.slow),  # the family is seed's
    ],
)
def test_env_families_run_end_to_end(ray_session, tmp_path, env, arch, model):
    """Atari (CNN, frameskip 4, with and without LSTM) and MuJoCo (Gaussian head)."""
    result = _fit(
        tmp_path,
        arch,
        4_000 if env.startswith("ALE") else 2_000,
        env={"id": env, "num_envs": 4},
        # The Atari preset's 4 minibatches would not fit 2 recurrent unrolls.
        algo={"name": "vtrace", "unroll_length": 5, "batch_size": 2, "num_minibatches": 2},
        model=model,
    )
    m = result.metrics
    assert m["updates"] >= 1 and np.isfinite(m["loss"])
    frameskip = 4 if env.startswith("ALE") else 1
    assert m["env_frames"] == frameskip * m["agent_steps"]


def test_impala_reports_lag_and_refreshes_weights_at_its_cadence(ray_session, tmp_path):
    """Runners fetch weights every `weights_every` unrolls and the learner reports the lag.

    That IMPALA learns is `test_every_architecture_and_algorithm_learns_cartpole`'s
    claim, with its example spec. This test asked for learning too, with FAST_VTRACE's
    lr (3e-3, tuned for no lag) at the ~20 updates of lag that `weights_every: 2` makes:
    alone on the machine, 25 runs needed 52k to 163k frames (median 95k) to reach 3x
    random, one past the 150k it allowed. The cadence and the lag are this test's own;
    they hold in any run.
    """
    result = _fit(tmp_path, {"name": "impala", "weights_every": 2}, 60_000)
    _assert_artifacts(result)
    m = result.metrics
    assert result.stop_reason.startswith("env_frames"), m
    assert m["policy_lag"] > 0  # runners act with weights older than the learner's
    # one unroll = one group of 32 envs x 10 steps; a sync at start, then every 2 unrolls
    unrolls = m["env_vector_steps"] / (32 * FAST_VTRACE_T)
    assert 0.4 * unrolls / 2 <= m["weight_syncs"] <= unrolls / 2 + 1


def test_impala_weights_travel_once_per_version(ray_session, tmp_path):
    from rlfabric.architectures.impala import ImpalaLearner

    platform = Platform(
        arch="impala", algo=FAST_VTRACE, env="CartPole-v1", run={"logdir": str(tmp_path)}
    )
    learner = ray_session.remote(ImpalaLearner).remote(platform.spec, platform.env_info, None, None)
    try:
        first = ray_session.get(learner.weights.remote())
        again = ray_session.get(learner.weights.remote())
        assert first[0] == again[0] == 0
        assert first[1] == again[1]  # the same object: one copy for every runner
        weights = ray_session.get(first[1])
        assert set(weights) >= {"value.weight", "value.bias"}
    finally:
        ray_session.get(learner.stop.remote())
        ray_session.kill(learner)


def test_impala_weights_are_never_tagged_with_a_version_mid_update(ray_session, tmp_path):
    """An update steps the weights, then counts the version; a runner asking between the
    two must not get the new weights under the old version (a race a CI run once hit).
    It gets the last version without waiting, and the update publishes its own at its end,
    so back-to-back updates that never free the lock still reach the runners."""
    import threading

    from rlfabric.architectures.impala import ImpalaLearner

    platform = Platform(
        arch="impala", algo=FAST_VTRACE, env="CartPole-v1", run={"logdir": str(tmp_path)}
    )
    learner = ImpalaLearner(platform.spec, platform.env_info, None, None)  # in this process
    bias = learner.learner.algorithm.model.value.bias

    def step() -> None:  # what Learner.update does to the weights, before it counts
        with torch.no_grad():
            bias.add_(1.0)

    def count() -> None:  # and the end of Learner.update
        learner.learner.counters["updates"] += 1
        learner.learner.on_update()

    def published(ref) -> float:
        return float(ray_session.get(ref)["value.bias"][0])

    try:
        start = bias.item()
        assert learner.weights()[0] == 0
        with learner._update_lock:  # one whole update, not yet asked for by any runner
            step()
            count()
        mid_update, asked, next_update, done = (threading.Event() for _ in range(4))

        def trainer() -> None:  # two updates back to back: the lock is never free
            with learner._update_lock:
                step()
                mid_update.set()
                asked.wait(30)
                count()
                step()  # the next update, still under the lock
                next_update.set()
                done.wait(30)

        thread = threading.Thread(target=trainer)
        thread.start()
        mid_update.wait(30)
        version, ref = learner.weights()  # mid-update: the last published version
        assert (version, published(ref)) == (0, start)
        asked.set()
        next_update.wait(30)
        version, ref = learner.weights()  # published by the update that ended
        assert (version, published(ref)) == (2, start + 2.0)
        done.set()
        thread.join(30)
    finally:
        learner.stop()


def test_ga3c_adjuster_acts(ray_session, tmp_path):
    """Ten seconds of GA3C with a 2 s adjuster window: the walk moves and decides. (That
    GA3C learns is the CartPole example specs' test below, with each algorithm.)"""
    result = _fit(
        tmp_path,
        {"name": "ga3c", "autotune_interval_s": 2.0, "max_env_runners": 2},
        None,
        algo={**FAST_VTRACE, "batch_size": 32},
        run={"report_interval_s": 0.5, "stop": {"wall_time_s": 10.0}},
    )
    records = _assert_artifacts(result)
    m = result.metrics
    assert m["updates"] > 0 and np.isfinite(m["loss"])
    assert {"autotune_env_runners", "autotune_predictors", "autotune_trainers"} <= set(m)
    assert any(
        r["predictors"] != 2 or r["trainers"] != 2 or r["autotune_env_runners"] != 1
        for r in records
    )  # the walk changed something at least once
    log = (Path(result.logdir) / "run.log").read_text()
    assert "dynamic adjuster" in log


@pytest.mark.parametrize("algo", ["vtrace", "a3c", "ppo"])
@pytest.mark.parametrize("arch", ["seed", "impala", "ga3c"])
def test_every_architecture_and_algorithm_learns_cartpole(ray_session, tmp_path, arch, algo):
    """The example spec of each pair learns: a 20-episode mean of 100 (random play: 22)
    ends the run, within a frame budget that leaves room for a slow asynchronous run.

    Whether a learned return is kept to the end of a run is the matrix benchmark's
    question (benchmarks/cartpole_matrix.py), not this test's.
    """
    # Stops measured: 14k-107k frames (vtrace 32k-107k, a3c 21k-46k, ppo 14k-25k); the
    # budget only bounds a failing run, at twice or more of the slowest seen.
    frames = {"vtrace": 220_000, "a3c": 100_000, "ppo": 80_000}[algo]
    spec = Path(__file__).resolve().parents[1] / f"examples/specs/cartpole_{arch}_{algo}.yaml"
    result = Platform.from_yaml(
        spec,
        [
            f"run.stop.env_frames={frames}",
            "run.stop.episode_return_mean=100",
            "run.return_window=20",
            "run.display=none",
            f"run.logdir={tmp_path}",
            "run.checkpoint_interval_s=0",
        ],
    ).fit()
    # The final record comes after the stop (more episodes end meanwhile): the reason
    # holds the mean that stopped the run.
    assert result.stop_reason.startswith("episode_return_mean"), result.metrics
