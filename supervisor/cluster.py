"""Connect to the current Ray cluster, or start a local embedded one."""

from __future__ import annotations

import logging
import os
from typing import Any

# Ray advertises the host's network address unless this is set before it
# starts; remedy's local clusters stay on loopback. An explicit setting in
# the environment wins.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def connect(*, workers: int, quiet: bool = True) -> str:
    """Join a reachable cluster (RAY_ADDRESS, a job's driver, a running head) or start one.

    Returns "cluster" or "local" to say which.
    """
    os.environ.setdefault(LOOPBACK_ENV, "0")
    import ray  # noqa: PLC0415 - after the environment is set

    if ray.is_initialized():
        return "cluster"
    common: dict[str, Any] = {
        "log_to_driver": not quiet,
        "configure_logging": True,
        "logging_level": logging.ERROR,
    }
    try:
        ray.init(address="auto", **common)
        return "cluster"
    except ConnectionError:
        pass
    cpus = max(os.cpu_count() or 1, workers + 1)
    ray.init(
        num_cpus=cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        **common,
    )
    return "local"
