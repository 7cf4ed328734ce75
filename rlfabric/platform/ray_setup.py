"""Starting or joining Ray.

By default an embedded Ray is started, bound to loopback: Ray's job API runs
code for anyone who can reach it. Ray rewrites a node IP of 127.0.0.1 to the
interface address unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is in the
environment, so it is set (if unset) before the embedded Ray starts. With
`resources.address` or RAY_ADDRESS set (as under `ray job submit`), the run
joins that cluster instead.
"""

from __future__ import annotations

import logging
import os

import ray

from rlfabric.platform.spec import ResourcesConfig

LOOPBACK = "127.0.0.1"


def init_ray(resources: ResourcesConfig) -> bool:
    """Make sure Ray is up; return True if this call started or joined it."""
    if ray.is_initialized():
        return False
    address = resources.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        return True
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Ray announces on every start that it chose token authentication (the safe
    # default): news once, noise on every run. Its warning that auth is off stays.
    auth_log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    auth_log.addFilter(_token_auth_enabled_notice)
    try:
        ray.init(
            # "local": start our own, never join a cluster another process started here
            address="local",
            num_cpus=resources.num_cpus or os.cpu_count(),
            _node_ip_address=LOOPBACK,
            include_dashboard=resources.dashboard,
            dashboard_host=LOOPBACK,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
    finally:
        auth_log.removeFilter(_token_auth_enabled_notice)
    return True


def _token_auth_enabled_notice(record: logging.LogRecord) -> bool:
    """False (drop) for Ray's notice that token authentication is enabled."""
    return not record.getMessage().startswith("Token authentication is enabled")
