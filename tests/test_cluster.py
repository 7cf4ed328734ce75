"""Clusters: `ray job submit` to a two-node cluster on 127.0.0.1.

The test starts its own head and worker node (`ray.cluster_utils.Cluster` in a
subprocess), on loopback with ports of its own, next to the session's embedded Ray,
and stops only what it started. One cluster serves both claims (a spec runs as a Ray
job; its runners spread over the nodes), as each Ray start costs seconds on two cores.
"""

from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
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


#: A head (1 CPU, with the job API) and a worker node (2 CPUs) on 127.0.0.1, up until
#: stdin closes. `ray.cluster_utils.Cluster` rather than a second `ray start`: the
#: loopback setting (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0) refuses `ray start --address`.
CLUSTER = textwrap.dedent(
    """
    import sys
    from ray.cluster_utils import Cluster

    gcs, dashboard, *ports = map(int, sys.argv[1:])
    common = {"node_ip_address": "127.0.0.1"}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            **common, "gcs_server_port": gcs, "num_cpus": 1, "include_dashboard": True,
            "dashboard_host": "127.0.0.1", "dashboard_port": dashboard,
            "dashboard_agent_listen_port": ports[0], "metrics_export_port": ports[1],
            "runtime_env_agent_port": ports[2],
        },
    )
    cluster.add_node(
        **common, num_cpus=2, dashboard_agent_listen_port=ports[3],
        metrics_export_port=ports[4], runtime_env_agent_port=ports[5],
    )
    cluster.wait_for_nodes()
    print("up", flush=True)
    try:
        sys.stdin.read()
    finally:
        cluster.shutdown()
    """
)


@pytest.fixture
def ray_cluster(tmp_path) -> Iterator[str]:
    """The two-node `CLUSTER` in a subprocess; yields its dashboard (job API) address."""
    gcs, dashboard, *ports = free_ports(8)
    log = (tmp_path / "cluster.log").open("w")
    cluster = subprocess.Popen(
        [sys.executable, "-c", CLUSTER, str(gcs), str(dashboard), *map(str, ports)],
        env=loopback_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    try:
        assert cluster.stdout.readline().strip() == "up", (tmp_path / "cluster.log").read_text()
        address = f"http://127.0.0.1:{dashboard}"
        _wait_for_job_api(address)
        yield address
    finally:
        cluster.stdin.close()  # the script shuts its cluster down
        cluster.wait(timeout=60)
        log.close()
    leftover = subprocess.run(
        ["pgrep", "-f", f"gcs_server.*--gcs_server_port={gcs}"], capture_output=True
    )
    assert leftover.returncode == 1, "the cluster's GCS outlived it"


def _wait_for_job_api(address: str) -> None:
    """The head needs a moment for its job API; `ray job submit` retries only briefly."""
    for _ in range(60):
        probe = subprocess.run(
            [str(BIN / "ray"), "job", "list", "--address", address],
            env=loopback_env(),
            capture_output=True,
            timeout=60,
        )
        if probe.returncode == 0:
            return
        subprocess.run(["sleep", "1"])
    raise TimeoutError(f"no job API at {address} after 60 tries")


def _submit(address: str, *command: str) -> None:
    """`ray job submit --working-dir <repo> -- rlfabric ...` to the cluster, to its end."""
    submit = subprocess.run(
        [
            *(str(BIN / "ray"), "job", "submit", "--address", address),
            *("--working-dir", str(ROOT), "--", "rlfabric", *command),
        ],
        env=loopback_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "succeeded" in submit.stdout, submit.stdout[-3000:] + submit.stderr[-3000:]


def test_ray_job_submit_runs_a_spec_with_runners_on_both_nodes_and_a_search(ray_cluster, tmp_path):
    logdir = tmp_path / "runs"
    _submit(
        ray_cluster,
        "train",
        "examples/specs/cartpole_seed_vtrace.yaml",
        "run.stop.env_frames=20000",
        "resources.num_env_runners=2",
        "resources.learner_cpus=0.5",
        "resources.cpus_per_env_runner=0.5",
        f"run.logdir={logdir}",
        "run.name=job",
        "run.display=plain",
    )
    records = (logdir / "job" / "metrics.jsonl").read_text().splitlines()
    last = json.loads(records[-1])
    assert last["env_frames"] >= 20_000
    assert last["runner_nodes"] == 2
    assert list((logdir / "job" / "checkpoints").glob("ckpt_*.pt"))

    # `-- rlfabric tune`: the search joins the cluster (one cluster for both: its start
    # is the slow part), and its trials' placement groups fit the cluster's CPUs.
    _submit(
        ray_cluster,
        "tune",
        "examples/specs/cartpole_seed_vtrace.yaml",
        "tune.num_samples=1",
        "tune.scheduler.name=fifo",
        "tune.search.algo.lr={grid: [0.001, 0.003]}",
        "run.stop.env_frames=10000",
        f"run.logdir={logdir}",
        "run.name=search",
    )
    with (logdir / "search" / "trials.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert sorted(float(row["algo.lr"]) for row in rows) == [0.001, 0.003]
    assert all(row["status"].startswith("done") for row in rows), rows
