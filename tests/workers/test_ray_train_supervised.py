"""Ray Train's loop function run by remedy's supervisor (`cli.ray_train.run_supervised`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from remedy.cli import ray_train, registry
from remedy.protocol.exceptions import UsageError
from remedy.rundir.claim import MARKER as CLAIM_MARKER
from remedy.rundir.writer import read_jsonl

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import launched_train  # noqa: E402 - the loop beside this file


def _loop(config: dict[str, int]) -> int:
    return config["a"] + 1


def test_the_loop_and_its_config_travel_to_the_ranks(tmp_path: Path) -> None:
    """The pickled loop is called with its config by the ranks' target, its module by value."""
    path = tmp_path / ray_train.LOOP_FILE
    path.write_bytes(ray_train._pickled(_loop, {"a": 41}))
    assert ray_train.run_loop([str(path)]) == 42


def test_scaling_from_num_workers_or_a_scaling_config() -> None:
    """`num_workers` or ScalingConfig's `num_workers` and `use_gpu`; a clash is one line."""
    ray_train_api = pytest.importorskip("ray.train")
    assert ray_train._scaling(None, None) == (1, 0.0)
    config = ray_train_api.ScalingConfig(num_workers=3, use_gpu=False)
    assert ray_train._scaling(None, config) == (3, 0.0)
    with pytest.raises(UsageError, match=r"num_workers=2 and scaling_config.num_workers=3 differ"):
        ray_train._scaling(2, config)
    with pytest.raises(UsageError, match="at least 1"):
        ray_train._scaling(0, None)


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_run_supervised_nan_on_rank_1_is_one_decision(
    ray_cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The `TorchTrainer` loop of test_ray_train, run by `run_supervised` on 2 gloo ranks: a NaN
    loss on rank 1 is one decision for the group, and the run completes with equal parameters.
    The run is in the registry as a `remedy run` is, and its directory is claimed."""
    monkeypatch.setenv("REMEDY_HOME", str(tmp_path / "home"))
    chaos = tmp_path / "chaos.yaml"
    chaos.write_text("faults:\n  - {kind: nan_loss, at_step: 12, rank: 1}\n")
    run_dir = tmp_path / "run"
    summary = ray_train.run_supervised(
        launched_train.ray_train_loop,
        train_loop_config={"run_dir": str(run_dir), "steps": 30},
        num_workers=2,
        run_dir=run_dir,
        chaos=chaos,
    )
    assert summary["status"] == "completed", summary
    assert summary["steps_completed"] == 30
    decisions = read_jsonl(run_dir / "decisions.jsonl")
    assert decisions, "no decision"
    first = decisions[0]
    assert (first["anomaly"]["kind"], first["anomaly"]["rank"]) == ("nonfinite_loss", 1)
    # One incident: every decision is of the first one's chain.
    assert {d["chain"]["id"] for d in decisions} == {first["decision_id"]}
    params = [torch.load(run_dir / "out" / f"params.rank{r}.pt") for r in (0, 1)]
    assert params[0].keys() == params[1].keys()
    assert all(torch.equal(params[0][k], params[1][k]) for k in params[0])
    written = json.loads((run_dir / "summary.json").read_text())
    assert written["status"] == "completed"
    (entry,) = registry.runs()
    assert (entry["run_dir"], entry["state"]) == (str(run_dir), "completed")
    with pytest.raises(UsageError, match="already holds a run"):
        ray_train.run_supervised(launched_train.ray_train_loop, num_workers=2, run_dir=run_dir)


def test_a_directory_another_run_claimed_is_refused_before_ray(tmp_path: Path) -> None:
    """A run directory claimed by a run is refused in one line; nothing is written into it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / CLAIM_MARKER).write_text("other-run\n")
    with pytest.raises(UsageError, match="already holds a run"):
        ray_train.run_supervised(_loop, num_workers=1, run_dir=run_dir)
    assert not (run_dir / ray_train.LOOP_FILE).exists()
