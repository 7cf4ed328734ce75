"""The embedded Ray stays on loopback however the process was started."""

from __future__ import annotations

import os
import subprocess
import sys

#: Imports ray before anything sets the loopback variable (a script importing ray or
#: rlfabric before it runs), then asks Ray where a node given 127.0.0.1 would listen.
PROBE = """
import ray
from ray._private import services
from rlfabric.platform.ray_setup import bind_loopback
bind_loopback()
print(services.resolve_ip_for_localhost("127.0.0.1"))
"""


def test_an_embedded_ray_binds_loopback_when_ray_was_imported_first():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "127.0.0.1"
