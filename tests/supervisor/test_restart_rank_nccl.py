"""NCCL path of restart_rank: a hung rank of a 2-GPU job is replaced; the survivor's communicators are aborted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from remedy.cli.runner import run_supervised
from remedy.protocol.spec import RunSpec
from remedy.rundir.writer import read_jsonl

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.ray,
    pytest.mark.slow,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (one per NCCL rank)"
    ),
]

REPO = Path(__file__).resolve().parents[2]
TARGET = f"{REPO / 'examples' / 'pretrain_gpt.py'}:main"
ARGS = ["--steps", "40", "--layers", "1", "--width", "32", "--batch-size", "4",
        "--block-size", "32", "--sample-every", "0"]  # fmt: skip


@pytest.mark.timeout(300)
def test_hung_nccl_rank_is_replaced(ray_cluster: None, tmp_path: Path) -> None:
    """hang_rank on rank 1 of 2 NCCL ranks -> restart_rank applied; both ranks end with equal parameters."""
    spec = RunSpec(
        target=TARGET, workers=2, run_dir=str(tmp_path), argv=ARGS, gpus_per_rank=1.0,
        faults=[{"kind": "hang_rank", "at_step": 20, "rank": 1}], hang_watch={"first_step_s": 4.0},
    )  # fmt: skip
    summary = run_supervised(spec)
    assert summary["status"] == "completed", summary
    assert len({r["result"]["params_digest"] for r in summary["ranks"]}) == 1
    restart = [d for d in read_jsonl(tmp_path / "decisions.jsonl") if d["action"] == "restart_rank"]
    assert restart and restart[0]["outcome"] == "applied"
