"""Policies from untrusted bytes: a Policy or a located PolicyError, never another exception."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remedy.policies import Policy, PolicyError
from remedy.supervisor.policy_source import (
    MAX_POLICY_BYTES,
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
