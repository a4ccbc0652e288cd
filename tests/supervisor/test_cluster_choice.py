"""Which Ray `remedy run` uses, from `--address` and the environment; probing a named one."""

from __future__ import annotations

import socket
import tempfile
import time
from pathlib import Path

import pytest

from remedy.cli.cluster import Choice, choose, probe
from remedy.protocol.exceptions import ClusterError


@pytest.mark.parametrize(
    ("flag", "env", "expected"),
    [
        (None, {}, Choice("local", None, "default")),
        (None, {"RAY_ADDRESS": "local"}, Choice("local", None, "--address local")),
        (
            None,
            {"RAY_ADDRESS": "10.0.0.5:6379"},
            Choice("cluster", "10.0.0.5:6379", "$RAY_ADDRESS"),
        ),
        ("local", {"RAY_ADDRESS": "10.0.0.5:6379"}, Choice("local", None, "--address local")),
        (
            "10.0.0.6:6379",
            {"RAY_ADDRESS": "10.0.0.5:6379"},
            Choice("cluster", "10.0.0.6:6379", "--address"),
        ),
        (
            "auto",
            {"RAY_ADDRESS": "10.0.0.5:6379"},
            Choice("cluster", "10.0.0.5:6379", "--address auto ($RAY_ADDRESS)"),
        ),
    ],
)
def test_choice(flag: str | None, env: dict[str, str], expected: Choice) -> None:
    """$RAY_ADDRESS names the cluster unless --address says otherwise; nothing else means private."""
    assert choose(flag, env) == expected


def test_auto_reads_what_ray_start_recorded(tmp_path: Path) -> None:
    """`--address auto` joins the cluster `ray start` recorded, and is an error when there is none."""
    env = {"RAY_TMPDIR": str(tmp_path)}
    with pytest.raises(ClusterError, match="no running Ray cluster found"):
        choose("auto", env)
    (tmp_path / "ray_current_cluster").write_text("127.0.0.1:6390\n")
    assert choose("auto", env) == Choice("cluster", "127.0.0.1:6390", "--address auto (ray start)")
    # RAY_ADDRESS=auto, Ray's own spelling, means the same.
    assert choose(None, {**env, "RAY_ADDRESS": "auto"}) == choose("auto", env)


def test_auto_without_a_recorded_cluster_says_to_set_ray_tmpdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `ray start --temp-dir X` cluster records its address in X, where `auto` looks only
    when RAY_TMPDIR says so: the error names the file it read and the variable to set."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "default"))
    started = tmp_path / "x"
    started.mkdir()
    (started / "ray_current_cluster").write_text("127.0.0.1:6391\n")
    with pytest.raises(ClusterError) as info:
        choose("auto", {})
    text = str(info.value)
    assert str(tmp_path / "default" / "ray" / "ray_current_cluster") in text
    assert "`ray start --temp-dir DIR` cluster is found with RAY_TMPDIR=DIR" in text
    assert "\n" not in text
    assert choose("auto", {"RAY_TMPDIR": str(started)}).address == "127.0.0.1:6391"
    with pytest.raises(ClusterError, match="RAY_TMPDIR=/nowhere names the `ray start"):
        choose("auto", {"RAY_TMPDIR": "/nowhere"})


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("http://127.0.0.1:8265", "not a URL"),
        ("127.0.0.1", "expected HOST:PORT"),
        ("127.0.0.1:0", "expected HOST:PORT"),
        ("no-such-host.invalid:6379", "no Ray cluster answers"),
    ],
)
def test_probe_refuses_bad_addresses(address: str, message: str) -> None:
    """A malformed or unresolvable address is one line."""
    with pytest.raises(ClusterError, match=message):
        probe(address)


def test_probe_of_something_that_is_not_ray_is_quick() -> None:
    """A port that accepts connections but speaks no Ray gRPC is refused within the probe's deadline."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    t0 = time.monotonic()
    try:
        with pytest.raises(ClusterError, match=f"no Ray cluster answers at 127.0.0.1:{port}"):
            probe(f"127.0.0.1:{port}", timeout_s=1.0)
    finally:
        server.close()
    assert time.monotonic() - t0 < 30  # a hang bound, not a performance threshold
