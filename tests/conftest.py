"""Shared fixtures: one local Ray for the whole session, and a clean worker context per test."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from remedy.rank.link.context import set_context

REPO = Path(__file__).resolve().parent.parent


def _gpu_visible() -> bool:
    import torch  # noqa: PLC0415

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _gpu_visible():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _reset_worker_context() -> Iterator[None]:
    """No test leaks a worker context into the next."""
    set_context(None)
    yield
    set_context(None)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Tiny models on one intra-op thread: faster here, where more threads fight other jobs on 2 cores.

    Opt in with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`; restored afterwards.
    """
    import torch  # noqa: PLC0415

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A local Ray on 127.0.0.1, started once per session and stopped at the end."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray  # noqa: PLC0415

    ray.init(
        num_cpus=4,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _temp_dir=str(tmp_path_factory.mktemp("ray")),
        log_to_driver=False,
        logging_level="ERROR",
        # As on the Rays remedy starts: a hung actor is SIGKILLed 0.1 s after ray.kill().
        _system_config={"kill_worker_timeout_milliseconds": 100},
    )
    yield
    ray.shutdown()
