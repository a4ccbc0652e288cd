"""Whatever bytes are saved over a running job's policy file, or sent with `policy apply`, the run goes on.

Each bad policy is refused, journaled in history.jsonl with its errors, and the
policy in force is kept; a good one saved afterwards still applies.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from remedy.cli.main import main
from remedy.protocol.spec import RunSpec
from remedy.supervisor.actor import SupervisorActor
from tests.supervisor.runs import finished

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
TINY = f"{REPO / 'tests' / 'robustness' / 'targets' / 'tiny.py'}:main"
V1 = "version: 1\nname: v1\nrules:\n  - name: nan\n    when: {anomaly: nonfinite_loss}\n    do: [notify]\n"
V2 = V1.replace("name: v1", "name: v2")
HOSTILE: dict[str, bytes] = {
    "not-utf8": V1.replace("name: v1", "name: caf\xe9").encode("latin-1"),
    "binary": bytes(range(256)) * 8,
    "nested-lists": b"version: 1\nrules: " + b"[" * 5000 + b"]" * 5000 + b"\n",
    "nested-maps": b"version: 1\nrules: " + b"{a: " * 3000 + b"1" + b"}" * 3000 + b"\n",
    "utf16": V1.encode("utf-16"),
    "empty": b"",
    "oversized": b"version: 1\nrules: []\n" + b"#" * (2 << 20),
}


def _wal(path: Path) -> list[dict[str, Any]]:
    """The journal's complete records (the last line may be mid-write)."""
    records = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                records.append(json.loads(line))
    return records


def _wait_for(path: Path, kind: str, count: int, timeout_s: float = 60) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [r for r in _wal(path) if r.get("type") == kind]
        if len(found) >= count:
            return found
        time.sleep(0.1)
    raise AssertionError(f"no {count} {kind} records in {path}")


def _save(path: Path, data: bytes, n: int) -> None:
    """Write and give the file a new mtime, so the watcher sees every save."""
    path.write_bytes(data)
    stamp = time.time_ns() + n * 1_000_000
    os.utime(path, ns=(stamp, stamp))


@pytest.mark.slow
def test_hostile_saves_and_applies_never_kill_the_run(
    ray_cluster: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Non-UTF-8, binary, deeply nested, empty and oversized policies are refused and journaled; the run completes."""
    policy = tmp_path / "p.yaml"
    policy.write_text(V1)
    run_dir = tmp_path / "run"
    argv = ["--steps", "1000", "--sleep", "0.01"]
    spec = RunSpec(target=TINY, policy=str(policy), run_dir=str(run_dir), argv=argv)
    actor = SupervisorActor.options(  # type: ignore[attr-defined]
        name=f"remedy-supervisor-{spec.run_id}", namespace="remedy"
    ).remote(spec.to_dict())
    actor.start.remote()
    deadline = time.monotonic() + 120
    while max(ray.get(actor.status.remote(spec.token))["step"].values(), default=0) < 3:
        assert time.monotonic() < deadline, "the run never started"
        time.sleep(0.2)
    history = run_dir / "history.jsonl"
    for n, data in enumerate(HOSTILE.values(), start=1):
        _save(policy, data, n)
        _wait_for(history, "policy_refused", n)
    # The same bytes sent directly, past the CLI's own check, are refused too.
    errors = ray.get(actor.apply_policy.remote(HOSTILE["binary"], "sent.yaml", spec.token))
    assert errors and errors[0].startswith("sent.yaml:")
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(HOSTILE["nested-lists"])
    assert main(["policy", "apply", str(bad), "--run", spec.run_id]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{bad}:") and "Traceback" not in err
    assert ray.get(actor.status.remote(spec.token))["policy"] == "v1"
    _save(policy, V2.encode(), len(HOSTILE) + 1)
    _wait_for(history, "policy_reloaded", 1)
    assert ray.get(actor.status.remote(spec.token))["policy"] == "v2"
    summary = finished(actor)
    assert summary["status"] == "completed"
    refused = [r for r in _wal(history) if r.get("type") == "policy_refused"]
    assert len(refused) == len(HOSTILE) + 1  # every save, and the direct call
    for record in refused:
        assert record["kept"] == "v1" and record["errors"], record
    assert (run_dir / "summary.json").exists()
