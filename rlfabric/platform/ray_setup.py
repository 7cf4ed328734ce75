"""Starting or joining Ray.

By default an embedded Ray is started, bound to loopback: Ray's job API runs
code for anyone who can reach it. Ray rewrites a node IP of 127.0.0.1 to the
interface address unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is in the
environment, and it reads that variable once, when `ray` is imported: so it is set
(if unset) for the processes the embedded Ray starts, and Ray's flag in this
process follows it (`bind_loopback`). With
`resources.address` or RAY_ADDRESS set (as under `ray job submit`), the run
joins that cluster instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator

import ray
from ray._private import ray_constants

from rlfabric.platform.spec import ResourcesConfig

LOOPBACK = "127.0.0.1"


def init_ray(resources: ResourcesConfig) -> bool:
    """Make sure Ray is up; return True if this call started or joined it."""
    if ray.is_initialized():
        return False
    address = resources.address or os.environ.get("RAY_ADDRESS")
    if address:
        with _keep_sigterm_handler():
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        return True
    bind_loopback()
    # Ray announces on every start that it chose token authentication (the safe
    # default): news once, noise on every run. Its warning that auth is off stays.
    auth_log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    auth_log.addFilter(_token_auth_enabled_notice)
    try:
        with _keep_sigterm_handler():
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


def bind_loopback() -> None:
    """Keep the embedded Ray's node IP at 127.0.0.1, unless the user asked otherwise.

    Ray resolves a node IP of 127.0.0.1 to the interface address when its cluster
    flag is on, and it computed that flag from RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER
    when `ray` was first imported: setting the variable afterwards (as a script that
    imports ray, or rlfabric, before it starts a run does) left every Ray process
    listening on the network. The variable reaches the processes Ray starts; the
    flag is this process's copy of it (Ray exposes no public switch).
    """
    os.environ.setdefault(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, "0")
    if os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] == "0":
        ray_constants.ENABLE_RAY_CLUSTER = False


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While a run trains, SIGTERM ends it as Ctrl-C does: final checkpoint, actors stopped.

    SIGTERM is what `ray job stop`, Slurm and Kubernetes send before they kill. Without
    a handler a script's `fit()` died at once (or by the crash handler `ray.init()`
    installs), losing everything since the last periodic checkpoint. A handler the
    program set itself is kept; outside the main thread signals never arrive.
    """
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        yield
        return
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _keep_sigterm_handler() -> Iterator[None]:
    """Put back a Python SIGTERM handler that `ray.init()` replaces.

    Ray's core worker installs a crash handler for SIGTERM in the driver that logs a
    stack trace and ends the process, in place of `rlfabric train`'s (SIGTERM, what
    `ray job stop` sends, ends a run as Ctrl-C does: final checkpoint, actors stopped).
    A process without a Python handler keeps Ray's.
    """
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if callable(handler):
            signal.signal(signal.SIGTERM, handler)


def _token_auth_enabled_notice(record: logging.LogRecord) -> bool:
    """False (drop) for Ray's notice that token authentication is enabled."""
    return not record.getMessage().startswith("Token authentication is enabled")
