"""Clusters: `ray job submit` to a head on 127.0.0.1, and runners spread over two nodes.

Each test starts its own Ray (a head from the `ray` CLI, or `ray.cluster_utils.Cluster`
in a subprocess) on loopback with ports of its own, next to the session's embedded
Ray, and stops only what it started.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def loopback_env() -> dict[str, str]:
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.pop("RAY_ADDRESS", None)
    if (Path.home() / ".ray" / "auth_token").exists():
        env["RAY_AUTH_MODE"] = "token"  # Ray 2.60's token auth: the job client needs it
    return env


@pytest.fixture
def ray_head(tmp_path):
    """A `ray start --head --block` on 127.0.0.1; yields the dashboard (job API) address."""
    gcs, dashboard, *agent_ports = free_ports(7)
    cmd = [
        str(BIN / "ray"),
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1",
        "--include-dashboard=true",
        "--num-cpus=2",
        f"--port={gcs}",
        f"--dashboard-port={dashboard}",
        f"--dashboard-agent-listen-port={agent_ports[0]}",
        f"--dashboard-agent-grpc-port={agent_ports[1]}",
        f"--metrics-export-port={agent_ports[2]}",
        f"--runtime-env-agent-port={agent_ports[3]}",
        f"--ray-client-server-port={agent_ports[4]}",
    ]
    log = (tmp_path / "head.log").open("w")
    head = subprocess.Popen(cmd, env=loopback_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{dashboard}"
    finally:
        head.send_signal(signal.SIGTERM)  # --block: ray start stops what it started
        head.wait(timeout=60)
        log.close()
        leftover = subprocess.run(
            ["pgrep", "-f", f"gcs_server.*--gcs_server_port={gcs}"], capture_output=True
        )
        assert leftover.returncode == 1, "the head's GCS outlived it"


def test_ray_job_submit_runs_a_spec_on_the_cluster(ray_head, tmp_path):
    logdir = tmp_path / "runs"
    env = loopback_env()
    # The head needs a moment for its job API; `ray job submit` retries only briefly.
    for _ in range(60):
        probe = subprocess.run(
            [str(BIN / "ray"), "job", "list", "--address", ray_head],
            env=env,
            capture_output=True,
            timeout=60,
        )
        if probe.returncode == 0:
            break
        subprocess.run(["sleep", "1"])
    submit = subprocess.run(
        [
            str(BIN / "ray"),
            "job",
            "submit",
            "--address",
            ray_head,
            "--working-dir",
            str(ROOT),
            "--",
            "rlfabric",
            "train",
            "examples/specs/cartpole_seed_vtrace.yaml",
            "run.stop.env_frames=20000",
            f"run.logdir={logdir}",
            "run.name=job",
            "run.display=plain",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "succeeded" in submit.stdout, submit.stdout[-3000:] + submit.stderr[-3000:]
    records = (logdir / "job" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(records[-1])["env_frames"] >= 20_000
    assert list((logdir / "job" / "checkpoints").glob("ckpt_*.pt"))


TWO_NODES = textwrap.dedent(
    """
    import json, sys
    from ray.cluster_utils import Cluster
    from rlfabric import Platform

    gcs, agent, grpc, metrics, runtime = map(int, sys.argv[1:6])
    common = {"node_ip_address": "127.0.0.1", "include_dashboard": False}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            **common, "gcs_server_port": gcs, "num_cpus": 1, "dashboard_agent_listen_port": agent,
            "metrics_export_port": metrics, "runtime_env_agent_port": runtime,
        },
    )
    cluster.add_node(**common, num_cpus=2, dashboard_agent_listen_port=grpc)
    cluster.wait_for_nodes()
    try:
        result = Platform(
            arch="seed",
            algo={"name": "vtrace", "optimizer": "adam", "lr": 3e-3, "loss_reduction": "mean",
                  "lr_schedule": "constant", "batch_size": 8, "unroll_length": 10},
            env={"id": "CartPole-v1", "num_envs": 16},
            resources={"address": cluster.address, "num_env_runners": 2,
                       "learner_cpus": 0.5, "cpus_per_env_runner": 0.5},
            run={"stop": {"env_frames": 30000}, "display": "none", "logdir": sys.argv[6]},
        ).fit()
        print(json.dumps({k: result.metrics[k] for k in ("runner_nodes", "env_frames")}))
    finally:
        cluster.shutdown()
    """
)


def test_runners_spread_over_two_nodes(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", TWO_NODES, *map(str, free_ports(5)), str(tmp_path)],
        env=loopback_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads(done.stdout.strip().splitlines()[-1])
    assert metrics["runner_nodes"] == 2
    assert metrics["env_frames"] >= 30_000
