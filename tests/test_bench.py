"""`rlfabric bench`: planning (validation before any run, example specs) and its outputs;
`benchmarks/reproduce.py --progress`, which reads any run's curve; and the variants of
`benchmarks/offpolicy.py`'s sparse-training comparison."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlfabric.errors import SpecError
from rlfabric.platform.bench import format_table, plan_bench, run_bench

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "specs"


def test_plan_starts_each_pair_from_its_example_spec(tmp_path):
    specs = plan_bench(
        None,
        "CartPole-v1",
        ["seed", "ga3c"],
        ["vtrace", "a3c"],
        1000,
        tmp_path,
        ["run.seed=4"],
        examples=EXAMPLES,
    )
    pairs = [(s.arch.name, s.algo.name) for s in specs]
    assert pairs == [("seed", "vtrace"), ("ga3c", "vtrace"), ("seed", "a3c"), ("ga3c", "a3c")]
    assert specs[0].algo.batch_size == 4 and specs[1].algo.batch_size == 32  # from the YAMLs
    assert all(s.run.seed == 4 and s.run.stop.env_frames == 1000 for s in specs)


def test_plan_refuses_a_bad_pair_before_running_anything(tmp_path):
    with pytest.raises(SpecError, match="unknown architecture 'mpi'"):
        plan_bench({}, "CartPole-v1", ["seed", "mpi"], ["vtrace"], 1000, tmp_path, [])


def test_bench_writes_table_json_and_plot(tmp_path):
    specs = plan_bench(
        {"env": {"id": "CartPole-v1", "num_envs": 8}},
        "CartPole-v1",
        ["local"],
        ["vtrace", "ppo"],
        3000,
        tmp_path,
        ["run.display=none", "run.return_window=5"],
    )
    rows = run_bench(specs, 20.0, tmp_path)
    assert [r["algo"] for r in rows] == ["vtrace", "ppo"]
    assert json.loads((tmp_path / "bench.json").read_text())[0]["env_frames"] >= 3000
    assert (tmp_path / "bench.png").stat().st_size > 1000
    table = format_table(rows)
    assert "local" in table and "frames/s" in table
    assert "thr: 5-episode mean return 20.0" in table
    # The first record with a full window of 5 episodes at or above the threshold.
    records = [json.loads(x) for x in (Path(rows[0]["logdir"]) / "metrics.jsonl").open()]
    hit = next(
        (r for r in records if r.get("episode_return_mean", 0) >= 20 and r["episodes"] >= 5), None
    )
    assert rows[0]["frames_to_threshold"] == (hit["env_frames"] if hit else None)


def _reproduce(*args: str) -> subprocess.CompletedProcess[str]:
    """benchmarks/reproduce.py as a user runs it (the benchmarks are scripts, not a package)."""
    script = EXAMPLES.parents[1] / "benchmarks" / "reproduce.py"
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=120
    )


def test_reproduce_progress_reads_a_curve_and_names_a_folder_without_one(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    records = [
        {"env_frames": 500_000, "updates": 10, "episode_return_mean": -21.0, "entropy": 1.79},
        {"env_frames": 1_000_000, "updates": 20, "episode_return_mean": -20.5, "entropy": 1.7},
        {"env_frames": 1_500_000, "updates": 30, "episode_return_mean": -19.0},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    done = _reproduce("--progress", str(run))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "run: 1M -20.50 (H 1.70) | end 1,500,000 frames, 30 updates, return -19.00"
    )

    empty = tmp_path / "typo"
    failed = _reproduce("--progress", str(run), str(empty))
    assert failed.returncode == 2
    assert f"{empty}: no records" in failed.stderr


def test_reproduce_record_writes_any_atari_run_as_a_result_and_names_a_folder_without_one(
    tmp_path,
):
    run = tmp_path / "probe"
    run.mkdir()
    records = [
        {"env_frames": 1_000, "agent_steps": 250, "wall_time_s": 1.0, "updates": 1},
        {"env_frames": 2_000, "agent_steps": 500, "wall_time_s": 2.04, "updates": 2,
         "episode_return_mean": 19.0, "episodes": 40},
        {"env_frames": 3_000, "agent_steps": 750, "wall_time_s": 3.0, "updates": 3,
         "episode_return_mean": 17.5, "episodes": 120},
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "spec.yaml").write_text("arch: seed\n")
    out = tmp_path / "results"
    done = _reproduce("--record", str(run), "--name", "p", "--reference", "a probe",
                      "--results", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads((out / "p.json").read_text())
    assert (out / "p.png").is_file()
    assert isinstance(result.pop("cpu_bf16"), bool)  # this machine's CPU: it read the run
    assert result.pop("frames_per_s") == 1_000
    assert result == {
        "name": "p",
        "reference": "a probe",
        "curves": {"probe": [[2_000, 19.0], [3_000, 17.5]]},
        "run": "probe",
        "env_frames": 3_000,
        "agent_steps": 750,
        "wall_time_s": 3.0,
        "final_return": 17.5,
        "frames_to_18": None,  # 19.0 was over 40 episodes, not a full window of 100
        "spec": "arch: seed\n",
    }
    assert json.loads(done.stdout)["final_return"] == 17.5

    failed = _reproduce("--record", str(tmp_path / "typo"), "--results", str(out))
    assert failed.returncode == 2
    assert f"{tmp_path / 'typo'}: no records" in failed.stderr


def test_offpolicy_rlx2_ablations_each_leave_out_one_part_of_rlx2(monkeypatch):
    """The ablations are RLx2 less its multi-step targets or less its dynamic buffer, on
    the same schedule, so that a run of each tells which part makes RLx2 differ from RigL."""
    benchmarks = EXAMPLES.parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(benchmarks))  # offpolicy.py imports reproduce.py
    spec = importlib.util.spec_from_file_location("offpolicy_bench", benchmarks / "offpolicy.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    sparse = {"sparse.actor=0.9", "sparse.critic=0.85", "sparse.method=rigl"}
    cases = [
        # the 300k-step HalfCheetah runs: every entry of RLx2's schedule x 0.1
        (
            {"max_steps": 300_000, "paper_steps": 3_000_000, "scale": False},
            sparse | {"sparse.delta=1000"},
            {"algo.n_step=3", "algo.n_step_after=30000"},
            {
                "algo.dynamic_buffer=true",
                "algo.buffer_check_every=1000",
                "algo.buffer_min_capacity=10000",
                "algo.buffer_capacity=100000",
            },
        ),
        # --scale: proportions of a 30k-step run with 25k updates
        (
            {"max_steps": 30_000, "paper_steps": None, "scale": True},
            sparse | {"sparse.delta=250"},
            {"algo.n_step=3", "algo.n_step_after=7500"},
            {
                "algo.dynamic_buffer=true",
                "algo.buffer_check_every=300",
                "algo.buffer_min_capacity=3000",
            },
        ),
    ]
    # rlx2_paper_buffer: the buffer as RLx2's code has it, whatever the run's length
    unscaled = {
        "algo.dynamic_buffer=true",
        "algo.buffer_check_every=10000",
        "algo.buffer_min_capacity=100000",
        "algo.buffer_capacity=1000000",
    }
    for steps, rigl, n_step, buffer in cases:
        args = argparse.Namespace(actor=0.9, critic=0.85, **steps)
        got = {v: bench.variant_overrides(v, "td3", args, 25_000) for v in bench.VARIANTS}
        assert all(len({o.split("=")[0] for o in ov}) == len(ov) for ov in got.values())
        assert set(got["rigl"]) == rigl
        assert set(got["rlx2"]) == rigl | n_step | buffer
        assert set(got["rlx2_no_nstep"]) == rigl | buffer
        assert set(got["rlx2_no_buffer"]) == rigl | n_step
        assert set(got["rlx2_paper_buffer"]) == rigl | n_step | unscaled
        assert got["dense"] == []
        assert got["dense_bf16"] == ["model.precision=bf16"]


def test_reproduce_compare_draws_the_runs_of_several_results_and_names_a_missing_one(
    tmp_path,
):
    results = []
    for name, points in (("a", [[0, -21.0], [2_000_000, -15.5]]), ("b", [[0, -20.0]])):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"curves": {f"{name}-s0": points}}))
        results.append(str(path))
    out = tmp_path / "both.png"
    done = _reproduce("--compare", *results, "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "a-s0: 2,000,000 frames, return -15.50",
        "b-s0: 0 frames, return -20.00",
        f"wrote {out}",
    ]
    assert out.stat().st_size > 0

    twice = _reproduce("--compare", results[0], results[0], "--out", str(out))
    assert twice.stdout.splitlines()[:2] == [
        "a-s0: 2,000,000 frames, return -15.50",
        "a: a-s0: 2,000,000 frames, return -15.50",
    ]

    missing = tmp_path / "c.json"
    failed = _reproduce("--compare", results[0], str(missing), "--out", str(out))
    assert failed.returncode == 2
    assert f"{missing}: not a result with curves" in failed.stderr
