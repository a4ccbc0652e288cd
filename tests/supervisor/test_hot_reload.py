"""A running job takes a new policy atomically; an invalid one is refused and the old one stays."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import ray

from remedy.cli import registry
from remedy.cli.main import main
from remedy.protocol.spec import RunSpec
from remedy.rundir.writer import read_jsonl
from remedy.supervisor.actor import SupervisorActor
from tests.supervisor.runs import finished

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
TARGET = f"{REPO / 'examples' / 'pretrain_gpt.py'}:main"

V1 = "version: 1\nname: v1\nrules:\n  - name: nan\n    when: {anomaly: nonfinite_loss}\n    do: [notify]\n"
V2 = V1.replace("name: v1", "name: v2")
BROKEN = "version: 1\nname: v3\nrules:\n  - name: nan\n    when: {anomaly: nonfinite_los}\n    do: [notify]\n"


def supervisor(tmp_path: Path, policy: Path) -> tuple[object, RunSpec]:
    spec = RunSpec(target=TARGET, policy=str(policy), run_dir=str(tmp_path / "run"))
    actor = SupervisorActor.options(  # type: ignore[attr-defined]
        name=f"remedy-supervisor-{spec.run_id}", namespace="remedy"
    ).remote(spec.to_dict())
    return actor, spec


def test_apply_policy_swaps_or_refuses(ray_cluster: None, tmp_path: Path) -> None:
    """A valid policy replaces the old one; an invalid one returns located errors and changes nothing."""
    policy = tmp_path / "p.yaml"
    policy.write_text(V1)
    actor, spec = supervisor(tmp_path, policy)
    errors = ray.get(actor.apply_policy.remote(BROKEN, "new.yaml", spec.token))  # type: ignore[attr-defined]
    assert errors and errors[0].startswith("new.yaml:5:")
    assert ray.get(actor.status.remote(spec.token))["policy"] == "v1"  # type: ignore[attr-defined]
    assert ray.get(actor.apply_policy.remote(V2, "new.yaml", spec.token)) == []  # type: ignore[attr-defined]
    assert ray.get(actor.status.remote(spec.token))["policy"] == "v2"  # type: ignore[attr-defined]
    ray.kill(actor)


def test_cli_policy_apply(
    ray_cluster: None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`remedy policy apply FILE --run ID` reloads a running job's policy with the run's token from
    the registry; a broken file exits 1 with locations; a wrong token is refused and counted."""
    monkeypatch.setenv("REMEDY_HOME", str(tmp_path / "home"))
    policy = tmp_path / "p.yaml"
    policy.write_text(V1)
    actor, spec = supervisor(tmp_path, policy)
    new = tmp_path / "v2.yaml"
    new.write_text(V2)
    address = ray.get_runtime_context().gcs_address
    entry = {"address": address, "mode": "cluster", "run_dir": spec.run_dir}
    registry.register(spec.run_id, {**entry, "token": "0" * 32})
    assert main(["policy", "apply", str(new), "--run", spec.run_id]) == 1
    assert "refused the call: the token in its registry entry is not the run's" in (
        capsys.readouterr().err
    )
    assert ray.get(actor.status.remote(spec.token))["rejected"] == {"token": 1}  # type: ignore[attr-defined]
    assert ray.get(actor.status.remote(spec.token))["policy"] == "v1"  # type: ignore[attr-defined]
    registry.register(spec.run_id, {**entry, "token": spec.token})
    assert main(["policy", "apply", str(new), "--run", spec.run_id]) == 0
    assert ray.get(actor.status.remote(spec.token))["policy"] == "v2"  # type: ignore[attr-defined]
    broken = tmp_path / "broken.yaml"
    broken.write_text(BROKEN)
    assert main(["policy", "apply", str(broken), "--run", spec.run_id]) == 1
    assert f"{broken}:5:" in capsys.readouterr().err
    assert main(["policy", "apply", str(new), "--run", "no-such-run"]) == 1
    ray.kill(actor)


def test_watched_policy_file_reloads_a_running_job(ray_cluster: None, tmp_path: Path) -> None:
    """Saving the policy file while the job runs applies it; the reload is journaled."""
    policy = tmp_path / "p.yaml"
    policy.write_text(V1)
    spec_args = ["--steps", "400", "--layers", "1", "--width", "32", "--sample-every", "0"]
    spec = RunSpec(
        target=TARGET, policy=str(policy), run_dir=str(tmp_path / "watched"), argv=spec_args
    )
    actor = SupervisorActor.remote(spec.to_dict())  # type: ignore[attr-defined]
    actor.start.remote()  # type: ignore[attr-defined]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status = ray.get(actor.status.remote(spec.token))  # type: ignore[attr-defined]
        if max(status["step"].values(), default=0) > 5:
            break
        time.sleep(0.2)
    policy.write_text(V2)
    summary = finished(actor)
    assert summary["status"] == "completed"
    history = read_jsonl(tmp_path / "watched" / "history.jsonl")
    reloads = [r for r in history if r.get("type") == "policy_reloaded"]
    assert reloads and reloads[0]["to"] == "v2"
