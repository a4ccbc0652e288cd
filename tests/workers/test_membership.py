"""A rank's rendezvous is bounded: a store that is gone is an error in seconds, not a 30 min wait."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch.distributed as dist

from remedy.workers import membership
from remedy.workers.membership import Membership, collective_timeout


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
