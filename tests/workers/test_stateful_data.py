"""A data source with state_dict/load_state_dict (torchdata's StatefulDataLoader) is rewound exactly by a rollback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from remedy.rank import Guard, GuardConfig, WorkerContext
from remedy.rank.chaos.faults import parse_chaos
from remedy.rank.state import train_state
from remedy.rank.state.data import BatchCursor
from remedy.rundir.writer import read_jsonl

# torchdata 0.11 calls a torch API torch 2.13 deprecates, on every iterator it makes.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

SAMPLES, BATCH = 80, 4  # 20 batches, one epoch

ROLLBACK_ONLY = """\
version: 1
name: rollback-only
rules:
  - name: nan
    when: {anomaly: nonfinite_loss}
    do:
      - rollback: {steps_back: 4, skip_batches: 3}
    max_fires: 1
"""


class Samples(torch.utils.data.Dataset[dict[str, Any]]):
    """Numbered samples of a small regression, the same on every read."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 4, generator=gen)
        self.y = torch.randn(SAMPLES, 1, generator=gen)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"id": i, "x": self.x[i], "y": self.y[i]}


def loader(seed: int = 1) -> StatefulDataLoader:
    # Shuffled: the sampler's generator is part of the loader's state, and must be rewound too.
    return StatefulDataLoader(
        Samples(), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )


def run(tmp_path: Path, faults: list[dict[str, Any]]) -> tuple[list[tuple[int, ...]], Guard]:
    """Train until the data runs out; the batch (its sample ids) of each logical step, as kept."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    policy = tmp_path / "policy.yaml"
    policy.write_text(ROLLBACK_ONLY)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    trained: dict[int, tuple[int, ...]] = {}  # logical step -> ids, the last time it trained
    holder: list[Guard] = []

    def loss_fn(m: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        trained[holder[0].next_step] = tuple(int(i) for i in batch["id"])
        return torch.nn.functional.mse_loss(m(batch["x"]), batch["y"])

    ctx = WorkerContext(run_dir=tmp_path / "run", faults=parse_chaos({"faults": faults}))
    config = GuardConfig(snapshot_every=5, checkpoint_every=0, policy=str(policy))
    guard = Guard(model, opt, loss_fn=loss_fn, data=loader(), epochs=1, config=config, context=ctx)
    holder.append(guard)
    for batch in guard:
        guard.step(batch)
    return [trained[s] for s in range(guard.step_count)], guard


@pytest.mark.timeout(180)
def test_a_rollback_trains_the_fault_free_batches_minus_the_skipped(tmp_path: Path) -> None:
    """NaN at step 12 -> rollback to step 5, 3 batches skipped: the steps kept trained exactly
    the fault-free run's batches with batches 5-7 left out, in the same order."""
    clean, _ = run(tmp_path / "clean", [])
    assert len(clean) == SAMPLES // BATCH
    faulty, guard = run(tmp_path / "faulty", [{"kind": "nan_loss", "at_step": 12}])
    [decision] = read_jsonl(tmp_path / "faulty" / "run" / "decisions.jsonl")
    assert decision["action"] == "rollback" and decision["outcome"] == "applied", decision
    assert "not rewound" not in str(decision)
    assert guard.summary["skipped_batches"] == [5, 6, 7]
    assert faulty == clean[:5] + clean[8:]


def test_the_cursor_saves_and_loads_a_stateful_source() -> None:
    """source_state at batch 3, read on to 6, restore_source: the next batch is batch 3 again."""
    cursor = BatchCursor(loader(), epochs=1)
    assert cursor.restorable and not cursor.rewindable
    for _ in range(3):
        cursor.next()
    saved = cursor.source_state()
    ahead = [cursor.next()[1]["id"].tolist() for _ in range(3)]
    cursor.restore_source(saved)
    again = [cursor.next()[1]["id"].tolist() for _ in range(3)]
    assert again == ahead and cursor.position == 6


def _plain_guard(data: StatefulDataLoader) -> Guard:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def loss_fn(m: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(m(batch["x"]), batch["y"])

    config = GuardConfig(detectors=[], snapshot_every=5, checkpoint_every=0)
    return Guard(model, opt, loss_fn=loss_fn, data=data, epochs=1, config=config,
                 context=WorkerContext())  # fmt: skip


def test_a_replacement_reads_its_own_loader_up_to_the_adopted_position() -> None:
    """A fresh rank adopting a peer's state at step 7 keeps its own loader (its rank's shard, here
    another shuffle) and reads it up to batch 7: its next batch is its own 8th, not the peer's."""
    peer = _plain_guard(loader(seed=1))
    it = iter(peer)
    for _ in range(7):
        peer.step(next(it))
    state = train_state.capture(peer)
    fresh = _plain_guard(loader(seed=2))
    train_state.adopt(fresh, state, joining=True)
    own = [b["id"].tolist() for b in loader(seed=2)]
    batch = next(iter(fresh))
    assert fresh.next_step == 7
    assert batch["id"].tolist() == own[7]
    peer.close()
    fresh.close()
