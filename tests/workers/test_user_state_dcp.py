"""A sharded model's DCP checkpoints hold the loop's own state objects, and a resume reads them back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from examples.gpt_model import lm_loss
from remedy.rank import Guard, GuardConfig
from remedy.rank.link.context import WorkerContext
from remedy.rank.state.dcp_store import DcpStore
from tests.workers.fsdp_ranks import backends, spawn_ranks
from tests.workers.test_fsdp_dcp import _rank_dir
from tests.workers.test_fsdp_guard import build, corpus, local_rows

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


class Tally:
    """A counter the loop bumps by `by` per step trained (Stateful)."""

    def __init__(self, by: int) -> None:
        self.by, self.n = by, 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = int(state["n"])


def _rank(rank: int, world: int, workdir: str, steps: int, resume: int | None) -> dict[str, Any]:
    root = Path(workdir)
    (root / "checkpoints").mkdir(parents=True, exist_ok=True)
    model = build(shard=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = corpus()
    shared, mine = Tally(1), Tally(10 * (rank + 1))
    ctx = WorkerContext(rank=rank, world_size=world, run_dir=_rank_dir(root, rank),
                        resume_step=resume)  # fmt: skip
    guard = Guard(model, opt, loss_fn=lm_loss, max_steps=steps, context=ctx, state={"shared": shared},
                  config=GuardConfig(detectors=[], snapshot_every=4, checkpoint_every=4),
                  data=lambda i: local_rows(data.batch(i), rank, world))  # fmt: skip
    guard.register_state("mine", mine, per_rank=True)
    assert isinstance(guard.checkpoints, DcpStore)
    first: tuple[int, int, int] | None = None
    for batch in guard:
        if first is None:
            first = (guard.next_step, shared.n, mine.n)
        guard.step(batch)
        shared.n += shared.by
        mine.n += mine.by
    guard.close()
    return {"first": first, "end": (guard.next_step, shared.n, mine.n)}


@pytest.mark.parametrize("backend", backends(2))
def test_dcp_resume_reads_back_each_ranks_state(tmp_path: Path, backend: str) -> None:
    """2 sharded ranks checkpoint through DCP; resumed from step 8, each rank's loop starts at
    next_step 8 with the replicated counter of step 8 and its own per-rank counter of step 8."""
    spawn_ranks(_rank, 2, tmp_path / "first", str(tmp_path), 10, None, backend=backend)
    again = spawn_ranks(_rank, 2, tmp_path / "again", str(tmp_path), 12, 8, backend=backend)
    for rank in (0, 1):
        assert again[rank]["first"] == (8, 8, 8 * 10 * (rank + 1))
        assert again[rank]["end"] == (12, 12, 12 * 10 * (rank + 1))
