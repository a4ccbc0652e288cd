"""DCP checkpoints of a sharded model: committed on every rank, checksummed, resharded 4 -> 2 ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.gpt_model import lm_loss
from remedy.rank import Guard, GuardConfig
from remedy.rank.link.context import WorkerContext
from remedy.rank.state.checkpoint_store import committed_steps
from remedy.rank.state.dcp_store import DcpStore
from tests.workers.fsdp_ranks import backends, spawn_ranks
from tests.workers.test_fsdp_guard import build, corpus, full_digest, local_rows

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _optim_digest(guard: Guard) -> list[float]:
    """Sum of each optimizer state tensor, whole (gathered through DTensor ops: a collective)."""
    out = []
    for state in guard.optimizer.state.values():
        for key in sorted(state):
            value = state[key]
            out.append(float(value.full_tensor().double().sum()) if key != "step" else float(value))
    return out


def _rank_dir(workdir: Path, rank: int) -> Path:
    """Each rank's own run directory, sharing one checkpoints folder (as under `remedy run`)."""
    run = workdir / f"rank{rank}"
    (run).mkdir(parents=True, exist_ok=True)
    link = run / "checkpoints"
    if not link.exists():
        link.symlink_to(workdir / "checkpoints", target_is_directory=True)
    return run


def _dcp_rank(
    rank: int, world: int, workdir: str, steps: int, resume: int | None, record_at: int
) -> dict[str, Any]:
    root = Path(workdir)
    (root / "checkpoints").mkdir(parents=True, exist_ok=True)
    model = build(shard=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = corpus()
    ctx = WorkerContext(rank=rank, world_size=world, run_dir=_rank_dir(root, rank),
                        resume_step=resume)  # fmt: skip
    guard = Guard(model, opt, loss_fn=lm_loss, max_steps=steps, context=ctx,
                  config=GuardConfig(detectors=[], snapshot_every=4, checkpoint_every=4),
                  data=lambda i: local_rows(data.batch(i), rank, world))  # fmt: skip
    assert isinstance(guard.checkpoints, DcpStore)
    out: dict[str, Any] = {}
    for batch in guard:
        if guard.step_count == record_at and "full" not in out:
            out["full"], out["optim"] = full_digest(model), _optim_digest(guard)
        guard.step(batch)
    out["summary"] = guard.close()
    return out


@pytest.mark.parametrize("backend", backends(4))
def test_dcp_checkpoint_resumes_resharded_on_fewer_ranks(tmp_path: Path, backend: str) -> None:
    """4 ranks write DCP checkpoints; 2 ranks resume from step 8 with the same whole model and optimizer."""
    four = spawn_ranks(_dcp_rank, 4, tmp_path / "four", str(tmp_path), 12, None, 8, backend=backend)
    ckpt = tmp_path / "checkpoints"
    assert committed_steps(ckpt, 4) == [4, 8, 12]
    manifest = json.loads((ckpt / "step-00000008.rank3.json").read_text())
    assert manifest["world_size"] == 4 and manifest["dcp"]["files"]
    two = spawn_ranks(_dcp_rank, 2, tmp_path / "two", str(tmp_path), 14, 8, 8, backend=backend)
    for rank in (0, 1):
        assert two[rank]["summary"]["resumed"]["step"] == 8
        assert two[rank]["full"] == four[0]["full"]  # the whole model, bitwise
        assert two[rank]["optim"] == four[0]["optim"]
        assert two[rank]["summary"]["steps_completed"] == 14


@pytest.mark.parametrize("backend", backends(2))
def test_corrupt_dcp_shard_falls_back_to_an_older_step(tmp_path: Path, backend: str) -> None:
    """A DCP file of one writer fails its checksum: every rank resumes from the newest older good step."""
    spawn_ranks(_dcp_rank, 2, tmp_path / "first", str(tmp_path), 8, None, 4, backend=backend)
    ckpt = tmp_path / "checkpoints"
    shard = next((ckpt / "dcp-step-00000008").glob("__1_*.distcp"))
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    second = spawn_ranks(
        _dcp_rank, 2, tmp_path / "second", str(tmp_path), 10, 8, 4, backend=backend
    )
    for rank in (0, 1):
        resumed = second[rank]["summary"]["resumed"]
        assert resumed["step"] == 4
        assert "step 8 failed its checksum on rank 1" in resumed["why"]
