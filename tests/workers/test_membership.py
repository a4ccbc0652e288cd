"""A rank's rendezvous is bounded: a store that is gone is an error in seconds, not a 30 min wait."""

from __future__ import annotations

import datetime
import socket
import threading
import time
import types
from pathlib import Path

import pytest
import torch.distributed as dist

from remedy.protocol import phases
from remedy.rank.group import ddp_layout, membership, regroup
from remedy.rank.group.membership import Membership, collective_timeout


def _closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(120)
def test_a_store_that_is_gone_fails_the_join_within_the_connect_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch retries a refused connection until the store's timeout; the join gives up after STORE_CONNECT_S."""
    monkeypatch.setattr(membership, "STORE_CONNECT_S", 1.0)
    m = Membership(rank=0, world_size=2, store_addr=("127.0.0.1", _closed_port()), backend="gloo")
    with pytest.raises(dist.DistNetworkError):
        m.join()  # with the collective timeout as the connect bound: 30 min here
    assert not dist.is_initialized()


def test_once_connected_the_store_waits_as_long_as_a_collective() -> None:
    """The short bound is for connecting only: the group's rendezvous waits keep the collective timeout."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    m = Membership(rank=0, world_size=1, store_addr=("127.0.0.1", server.port), backend="gloo")
    m.join()
    try:
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert (
            m._store.timeout
            == collective_timeout()
            > datetime.timedelta(seconds=membership.STORE_CONNECT_S)
        )
    finally:
        m.leave()


@pytest.mark.timeout(120)
def test_a_survivor_says_it_is_joining_while_it_forms_the_ordered_generation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its pings say `joining` for as long as its rendezvous lasts (gloo may hold it there
    for good, `phases.JOINING`, which only the supervisor can end), and `recovering` again
    once that rendezvous failed and it waits for the next order."""
    monkeypatch.setattr(membership, "REGROUP_WAIT_S", 0.5)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    m = Membership(rank=1, world_size=2, store_addr=("127.0.0.1", server.port), backend="gloo")
    guard = types.SimpleNamespace(
        step_count=7, sharded=False, mirror=None, send_report=lambda **_: None, membership=m
    )
    m.order(1, 0)  # rank 0, the source, never comes
    errors: list[BaseException] = []

    def survive() -> None:
        try:
            regroup.regroup(guard, RuntimeError("Connection closed by peer"))  # type: ignore[arg-type]
        except BaseException as exc:  # handed to the test's thread
            errors.append(exc)

    t = threading.Thread(target=survive, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while m.status()["phase"] != phases.JOINING and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (m.status()["phase"], m.status()["generation"]) == (phases.JOINING, 1)
    time.sleep(0.3)
    assert m.status()["phase"] == phases.JOINING  # still waiting for rank 0
    del server  # the store closes: the rendezvous fails, and the rank waits for an order
    t.join(timeout=30)
    assert not t.is_alive()
    assert [type(e).__name__ for e in errors] == ["GroupLostError"]
    assert m.status()["phase"] == phases.RECOVERING and m.status()["generation"] == 0
    assert not dist.is_initialized()


def test_rebuilding_ddp_keeps_its_settings_and_warns_nothing(tmp_path: Path) -> None:
    """A replacement rebuilds DDP on the new group with the same settings, and prints no
    warning of remedy's own into the user's output (no deprecated `broadcast_buffers`)."""
    import warnings  # noqa: PLC0415

    import torch  # noqa: PLC0415

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Linear(4, 2), forward_sync_buffers=False
        )
        guard = types.SimpleNamespace(model=model, detectors=types.SimpleNamespace(detectors=[]))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ddp_layout.rebuild_ddp(guard)  # type: ignore[arg-type]
        assert model.forward_sync_buffers is False
        model(torch.randn(3, 4)).sum().backward()
    finally:
        dist.destroy_process_group()
