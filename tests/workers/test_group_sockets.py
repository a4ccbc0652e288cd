"""A survivor breaks off the connections its broken group opened, and nothing else."""

from __future__ import annotations

import os
import socket
import sys

import pytest

from remedy.rank.group.group_sockets import GroupSockets

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/fd")


def test_release_shuts_down_what_opened_inside_and_spares_the_rest() -> None:
    """Connections opened inside `around` are shut down (the peer sees EOF); older ones and listeners are not."""
    outside = socket.create_server(("127.0.0.1", 0))
    old_client = socket.create_connection(outside.getsockname())
    old_server, _ = outside.accept()
    group = GroupSockets()
    with group.around():
        listener = socket.create_server(("127.0.0.1", 0))
        client = socket.create_connection(outside.getsockname())
    peer, _ = outside.accept()  # the peer's end, as in another process
    try:
        assert group.release() == 1
        peer.settimeout(2.0)
        assert peer.recv(1) == b""  # EOF at once, not a block
        old_client.sendall(b"x")
        assert old_server.recv(1) == b"x"  # untouched
        listener.settimeout(2.0)
        extra = socket.create_connection(listener.getsockname())  # the listener still accepts
        accepted, _ = listener.accept()
        extra.close()
        accepted.close()
        assert group.release() == 0  # once only
    finally:
        for s in (outside, old_client, old_server, listener, client, peer):
            s.close()


def test_a_descriptor_reused_after_close_is_not_touched() -> None:
    """A number the group's socket had, closed and then reused by another connection, is left alone."""
    listener = socket.create_server(("127.0.0.1", 0))
    group = GroupSockets()
    with group.around():
        first = socket.create_connection(listener.getsockname())
    first_peer, _ = listener.accept()
    fd = first.fileno()
    first.close()
    first_peer.close()
    again = socket.create_connection(listener.getsockname())
    again_peer, _ = listener.accept()
    duplicated = again.fileno() != fd
    if duplicated:  # the group's old number now names another connection
        os.dup2(again.fileno(), fd)
    try:
        assert group.release() == 0
        os.write(fd, b"y")
        assert again_peer.recv(1) == b"y"
    finally:
        if duplicated:
            os.close(fd)
        for s in (listener, again, again_peer):
            s.close()
