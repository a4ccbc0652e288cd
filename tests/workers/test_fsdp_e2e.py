"""Sharded (FSDP2) jobs under `remedy run`: real ranks as Ray actors on gloo."""

from __future__ import annotations

from pathlib import Path

import pytest

from remedy.supervisor.runner import run_supervised
from remedy.supervisor.spec import RunSpec

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

HERE = Path(__file__).resolve().parent


def test_readme_loop_with_fully_shard_trains_on_two_ranks(
    ray_cluster: None, tmp_path: Path
) -> None:
    """The README's DDP loop with fully_shard in place of DDP completes (it crashed in update_stall)."""
    spec = RunSpec(target=f"{HERE / 'fsdp_train.py'}:main", workers=2, run_dir=str(tmp_path),
                   argv=["30"], threads_per_rank=1)  # fmt: skip
    summary = run_supervised(spec)
    assert summary["status"] == "completed", summary["ranks"]
    ranks = summary["ranks"]
    assert [r["steps_completed"] for r in ranks] == [30, 30]
    assert ranks[0]["result"]["params_digest"] == ranks[1]["result"]["params_digest"]
