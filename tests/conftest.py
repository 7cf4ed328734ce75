"""Shared fixtures: one Ray session for every test that needs Ray."""

from __future__ import annotations

import os

import pytest

#: Environment of every test process and Ray worker: trackers send nothing beyond
#: 127.0.0.1 (MLflow's usage telemetry off, W&B's error reports off, W&B offline).
TRACKER_QUIET = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    "WANDB_ERROR_REPORTING": "false",
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
}


@pytest.fixture(scope="session")
def ray_session():
    """An embedded Ray on 127.0.0.1 shared by the whole session; Platform.fit reuses it."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.update(TRACKER_QUIET)  # a search's trials log from Ray workers
    # Workers inherit it: they import faulty_envs to make the envs it registers.
    tests = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (tests, os.environ.get("PYTHONPATH")) if p
    )
    import ray

    from rlfabric.platform.ray_setup import init_ray
    from rlfabric.platform.spec import ResourcesConfig

    started = init_ray(ResourcesConfig(num_cpus=2))
    yield ray
    if started:
        ray.shutdown()
