"""Policies from untrusted bytes: a Policy or a located PolicyError, never another exception."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remedy.policies import Policy, PolicyError
from remedy.supervisor.policy_source import (
    MAX_POLICY_BYTES,
    PolicyWatch,
    load_policy_source,
    policy_from_bytes,
)

GOOD = b"version: 1\nname: ok\nrules:\n  - name: nan\n    when: {anomaly: nonfinite_loss}\n    do: [notify]\n"
INPUTS = Path(__file__).resolve().parents[1] / "robustness" / "inputs" / "policies"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (GOOD.replace(b"ok", b"caf\xe9"), "2:10: error: policy file is not UTF-8 text (byte 0xe9)"),
        (GOOD.replace(b"notify", b"not\x00ify"), "6:13: error: control character U+0000"),
        (
            b"version: 1\nrules: " + b"[" * 5000 + b"]" * 5000,
            "2:136: error: nesting deeper than 32 levels",
        ),
        (b"#" * (MAX_POLICY_BYTES + 1), f"larger than {MAX_POLICY_BYTES} bytes"),
    ],
)
def test_hostile_bytes_are_refused_with_a_location(data: bytes, message: str) -> None:
    """Non-UTF-8, binary, deeply nested and oversized bytes are one located error each."""
    with pytest.raises(PolicyError) as err:
        policy_from_bytes(data, "p.yaml")
    assert len(err.value.diagnostics) == 1
    assert err.value.diagnostics[0].format().startswith("p.yaml:")
    assert message in str(err.value)


def test_good_bytes_and_text_load() -> None:
    """Valid bytes, or the same text, give the policy."""
    assert isinstance(policy_from_bytes(GOOD, "p.yaml"), Policy)
    assert policy_from_bytes(GOOD.decode(), "p.yaml").name == "ok"


@pytest.mark.parametrize("path", sorted(INPUTS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_hostile_file_loads_or_is_refused(path: Path) -> None:
    """Each file of the hostile folder is a Policy (good.yaml) or a PolicyError, nothing else."""
    if path.name == "good.yaml":
        assert load_policy_source(str(path)).name == "ok"
        return
    with pytest.raises(PolicyError):
        load_policy_source(str(path))


def test_unreadable_sources_are_refused(tmp_path: Path) -> None:
    """A folder, a device or a missing file is a PolicyError naming it."""
    for source in (str(tmp_path), "/dev/zero", str(tmp_path / "missing.yaml")):
        with pytest.raises(PolicyError) as err:
            load_policy_source(source)
        assert str(err.value).startswith(source)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=400),
        st.text(max_size=300).map(str.encode),
        st.lists(st.sampled_from([b"[", b"{a: ", b"- ", b"&x ", b"*x ", b"\n", b"version: 1"])).map(
            b"".join
        ),
        st.binary(max_size=60).map(lambda junk: GOOD[:40] + junk + GOOD[40:]),
    )
)
def test_any_bytes_give_a_policy_or_a_policy_error(data: bytes) -> None:
    """Whatever the bytes, loading returns a Policy or raises PolicyError."""
    try:
        policy_from_bytes(data, "fuzz.yaml")
    except PolicyError as exc:
        refused = exc.diagnostics
    else:
        return
    assert refused and all(d.file == "fuzz.yaml" for d in refused)


def _stamp(path: Path, ns: int) -> None:
    os.utime(path, ns=(ns, ns))


def test_a_save_is_taken_once_it_stands_still_and_once_per_content(tmp_path: Path) -> None:
    """A save is read after one look finds it unchanged; a touch or a second mtime of the same bytes is no new save."""
    path = tmp_path / "p.yaml"
    path.write_bytes(GOOD)
    watch = PolicyWatch(path)
    assert watch.poll() is None  # nothing saved
    v2 = GOOD.replace(b"name: ok", b"name: v2")
    path.write_bytes(v2)
    _stamp(path, 10**18)
    assert watch.poll() is None  # changed since the last look: not read yet
    assert watch.poll() == (v2, str(path))
    assert watch.poll() is None
    _stamp(path, 10**18 + 5)  # the same save's second mtime (or a touch)
    assert [watch.poll(), watch.poll()] == [None, None]
    path.write_bytes(GOOD)  # back to the start's bytes: a save like any other
    _stamp(path, 10**18 + 9)
    assert [watch.poll(), watch.poll()] == [None, (GOOD, str(path))]


def test_a_write_caught_midway_is_read_when_it_ends(tmp_path: Path) -> None:
    """A look between a writer's chunks only waits: what is read is the finished file."""
    path = tmp_path / "p.yaml"
    path.write_bytes(GOOD)
    watch = PolicyWatch(path)
    v2 = GOOD.replace(b"name: ok", b"name: v2")
    path.write_bytes(v2[:10])  # part-way
    _stamp(path, 10**18)
    assert watch.poll() is None
    path.write_bytes(v2)  # the rest, before the next look
    _stamp(path, 10**18 + 1)
    assert watch.poll() is None
    assert watch.poll() == (v2, str(path))


def test_the_same_refusal_is_not_repeated_and_policy_apply_resets(tmp_path: Path) -> None:
    """A bad save is refused once however often it is touched; after `policy apply` the file's next save is taken."""
    path = tmp_path / "p.yaml"
    path.write_bytes(GOOD)
    watch = PolicyWatch(path)
    path.unlink()
    path.mkdir()  # a folder in its place: unreadable
    assert watch.poll() is None
    with pytest.raises(PolicyError, match="not a regular file"):
        watch.poll()
    _stamp(path, 10**18)
    assert [watch.poll(), watch.poll()] == [None, None]
    path.rmdir()
    path.write_bytes(GOOD)
    _stamp(path, 10**18 + 3)
    assert [watch.poll(), watch.poll()] == [None, (GOOD, str(path))]
    watch.forget()  # a policy applied from elsewhere: the same bytes count again
    _stamp(path, 10**18 + 7)
    assert [watch.poll(), watch.poll()] == [None, (GOOD, str(path))]
