"""The Guard inside Ray Train's `TorchTrainer`, without a supervisor: the group decides once."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from remedy.rundir.writer import read_jsonl

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import launched_train  # noqa: E402 - the loop beside this file

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.mark.timeout(300)
def test_ray_train_nan_on_one_worker_is_one_group_decision(
    ray_cluster: None, tmp_path: Path
) -> None:
    """A NaN loss on worker 1 of a 2-worker `TorchTrainer` (gloo, CPU): one decision for the
    group, applied by both workers; both end with the same parameters."""
    ray_train = pytest.importorskip("ray.train")
    from ray import cloudpickle  # noqa: PLC0415
    from ray.train.torch import TorchConfig, TorchTrainer  # noqa: PLC0415

    chaos = tmp_path / "chaos.yaml"
    chaos.write_text("faults:\n  - {kind: nan_loss, at_step: 12, rank: 1}\n")
    run_dir = tmp_path / "run"
    # The workers cannot import this test folder: the loop travels by value.
    cloudpickle.register_pickle_by_value(launched_train)
    trainer = TorchTrainer(
        launched_train.ray_train_loop,
        train_loop_config={"run_dir": str(run_dir), "steps": 30, "chaos": str(chaos)},
        scaling_config=ray_train.ScalingConfig(num_workers=2, use_gpu=False),
        torch_config=TorchConfig(backend="gloo"),
        run_config=ray_train.RunConfig(
            storage_path=str(tmp_path / "ray_results"), name="remedy-ray-train"
        ),
    )
    trainer.fit()

    decisions = read_jsonl(run_dir / "decisions.jsonl")
    assert [d["action"] for d in decisions] == ["rollback", "shrink_lr"]
    assert {d["chain"]["id"] for d in decisions} == {decisions[0]["decision_id"]}
    anomaly = decisions[0]["anomaly"]
    assert (anomaly["kind"], anomaly["rank"]) == ("nonfinite_loss", 1)
    assert [(m["kind"], m["rank"]) for m in anomaly["details"]["merged"]] == [("nonfinite_grad", 0)]
    applied = [json.loads((run_dir / "out" / f"outcomes.rank{r}.json").read_text()) for r in (0, 1)]
    assert [o["tick"] for o in applied[0]] == [o["tick"] for o in applied[1]]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["launcher"] == "Ray Train"
    assert [r["steps_completed"] for r in summary["ranks"]] == [30, 30]


@pytest.mark.timeout(400)
def test_ray_train_restart_resumes_from_the_newest_committed_checkpoint(
    ray_cluster: None, tmp_path: Path
) -> None:
    """Worker 1 SIGKILLed at step 35 under `FailureConfig(max_failures=1)`: Ray Train starts the
    group again, every rank tells from the run directory that it is a restart and resumes from
    step 30 (the newest both committed), and completes. The NaN after the restart is decided
    once, with decision ids of the restarted group's own (`local-restart1-`)."""
    ray_train = pytest.importorskip("ray.train")
    from ray import cloudpickle  # noqa: PLC0415
    from ray.train.torch import TorchConfig, TorchTrainer  # noqa: PLC0415

    chaos = tmp_path / "chaos.yaml"
    chaos.write_text(
        "faults:\n  - {kind: nan_loss, at_step: 12, rank: 1}\n"
        "  - {kind: kill_rank, at_step: 35, rank: 1}\n"
        "  - {kind: nan_loss, at_step: 45, rank: 1}\n"
    )
    run_dir = tmp_path / "run"
    cloudpickle.register_pickle_by_value(launched_train)
    trainer = TorchTrainer(
        launched_train.ray_train_loop,
        train_loop_config={"run_dir": str(run_dir), "steps": 60, "chaos": str(chaos)},
        scaling_config=ray_train.ScalingConfig(num_workers=2, use_gpu=False),
        torch_config=TorchConfig(backend="gloo"),
        run_config=ray_train.RunConfig(
            storage_path=str(tmp_path / "ray_results"),
            name="remedy-ray-train-restart",
            failure_config=ray_train.FailureConfig(max_failures=1),
        ),
    )
    trainer.fit()

    decisions = read_jsonl(run_dir / "decisions.jsonl")
    assert [(d["step"], d["action"], d["outcome"]) for d in decisions] == [
        (12, "rollback", "applied"),
        (12, "shrink_lr", "applied"),
        (45, "rollback", "applied"),
        (45, "shrink_lr", "applied"),
    ]
    assert not any(d["decision_id"].startswith("local-restart") for d in decisions[:2])
    assert all(d["decision_id"].startswith("local-restart1-") for d in decisions[2:])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    for rank in summary["ranks"]:
        assert rank["steps_completed"] == 60
        assert rank["resumed"]["step"] == 30
    applied = [json.loads((run_dir / "out" / f"outcomes.rank{r}.json").read_text()) for r in (0, 1)]
    assert [o["decision_id"] for o in applied[0]] == [d["decision_id"] for d in decisions[2:]]
    assert [o["tick"] for o in applied[0]] == [o["tick"] for o in applied[1]]
