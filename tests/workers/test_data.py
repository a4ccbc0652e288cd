"""Running out of data ends training cleanly; epochs re-read a DataLoader; rollbacks say what they rewound."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from remedy.rank import Command, Guard, GuardConfig
from remedy.rank.state.data import BatchCursor, DataExhausted

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def job(samples: int = 64, batch_size: int = 8) -> tuple[torch.nn.Module, Any, DataLoader[Any]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(samples, 3), torch.randn(samples, 1))
    gen = torch.Generator().manual_seed(0)
    return model, opt, DataLoader(data, batch_size=batch_size, shuffle=True, generator=gen)


def test_a_dataloader_running_out_ends_training_cleanly(tmp_path: Path) -> None:
    """A plain DataLoader of 8 batches and max_steps=100: 8 steps, status completed, the reason
    in the summary and a summary.json that `remedy report` reads (no StopIteration crash)."""
    model, opt, loader = job()
    guard = Guard(model, opt, loss_fn=loss_fn, data=loader, max_steps=100, run_dir=tmp_path)
    steps = [guard.step(batch).step for batch in guard]
    summary = guard.close()
    assert steps == list(range(8))
    assert summary["status"] == "completed" and summary["steps_completed"] == 8
    assert summary["data_exhausted"] == "data exhausted after 8 batches (1 epoch)"
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["status"] == "completed" and written["steps_completed"] == 8
    assert written["ranks"][0]["final_loss_over_steps"] == 8


def test_epochs_reread_the_dataloader_and_max_steps_stops_earlier() -> None:
    """epochs=3 reads the 8-batch loader three times (24 steps, each epoch shuffled anew);
    max_steps=20 stops first; without max_steps the data decides."""
    model, opt, loader = job()
    guard = Guard(model, opt, loss_fn=loss_fn, data=loader, epochs=3)
    seen = [batch[0] for batch in guard if guard.step(batch) is not None]
    assert guard.close()["steps_completed"] == 24 and guard.cursor.epoch == 2
    assert not torch.equal(torch.cat(seen[:8]), torch.cat(seen[8:16]))
    model, opt, loader = job()
    guard = Guard(model, opt, loss_fn=loss_fn, data=loader, epochs=3, max_steps=20)
    for batch in guard:
        guard.step(batch)
    summary = guard.close()
    assert summary["steps_completed"] == 20 and summary["data_exhausted"] is None


def test_set_epoch_is_called_on_a_distributed_sampler() -> None:
    """Before every epoch the cursor calls DistributedSampler.set_epoch, so each rank's shard
    is reshuffled per epoch exactly as a hand-written DDP loop does."""
    data = TensorDataset(torch.arange(16.0).unsqueeze(1))
    sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
    cursor = BatchCursor(DataLoader(data, batch_size=4, sampler=sampler), epochs=3)
    epochs = []
    for _ in range(6):
        cursor.next()
        epochs.append(sampler.epoch)
    assert epochs == [0, 0, 1, 1, 2, 2]
    with pytest.raises(DataExhausted):
        cursor.next()


def test_indexable_data_ends_at_its_length_and_wraps_for_epochs() -> None:
    """A Dataset of batches with a length ends after len(data) batches, or wraps epochs times;
    a callable without a length goes on, and one raising IndexError ends there."""
    batches = [torch.full((2,), float(i)) for i in range(5)]
    cursor = BatchCursor(batches, epochs=2)
    assert [int(cursor.next()[1][0]) for _ in range(10)] == [0, 1, 2, 3, 4] * 2
    with pytest.raises(DataExhausted):
        cursor.next()

    def fetch(i: int) -> int:
        if i >= 3:
            raise IndexError(i)
        return i

    cursor = BatchCursor(fetch)
    assert [cursor.next()[1] for _ in range(3)] == [0, 1, 2]
    with pytest.raises(DataExhausted):
        cursor.next()


def test_epochs_need_a_source_that_can_be_read_again() -> None:
    """A generator cannot serve a second epoch: said at once, not at the end of the first."""
    with pytest.raises(ValueError, match="read once"):
        BatchCursor((x for x in range(3)), epochs=2)


def test_rollback_on_a_plain_iterable_says_the_data_was_not_rewound() -> None:
    """A rollback on a DataLoader restores the model but cannot rewind the data: the result and
    detail say so, and give the step restored and how far back that really was."""
    model, opt, loader = job(samples=320)
    guard = Guard(
        model,
        opt,
        loss_fn=loss_fn,
        data=loader,
        config=GuardConfig(detectors=[], snapshot_every=10),
    )
    it = iter(guard)
    for _ in range(26):
        guard.step(next(it))
    guard.submit(Command("rb", "rollback", {"steps_back": 20}, 0, anomaly_step=26))
    next(it)
    result = guard.history[-1].result
    assert result["restored_step"] == 0 and result["steps_back"] == 26
    assert result["data_rewound"] is False
    assert "restored step 0" in guard.history[-1].detail
    assert "26 steps back" in guard.history[-1].detail
    assert "not rewound" in guard.history[-1].detail
    guard.close()


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.out = torch.nn.Linear(8, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(ids))


def lm_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    (ids,) = batch
    return torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())


@pytest.mark.parametrize("as_epochs", [True, False])
def test_epochs_are_not_duplicate_samples_but_a_looping_source_is(as_epochs: bool) -> None:
    """Forty epochs over 64 token rows repeat every row by design: no duplicate_samples. The
    same rows served as one long pass (a source that keeps restarting by itself) are reported."""
    gen = torch.Generator().manual_seed(0)
    rows = TensorDataset(torch.randint(0, 50, (64, 33), generator=gen))
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(rows, batch_size=8, shuffle=True, generator=gen)
    data: Any = loader if as_epochs else [b for _ in range(40) for b in loader]
    guard = Guard(model, opt, loss_fn=lm_loss, data=data, epochs=40 if as_epochs else None)
    kinds = [k for batch in guard for k in guard.step(batch).events]
    assert guard.close()["steps_completed"] == 320
    assert ("duplicate_samples" in kinds) is not as_epochs, kinds


def test_a_plain_iterable_set_ahead_catches_up_before_its_next_batch() -> None:
    """A fresh process given a position (a resume, a replacement adopting a peer's state)
    reads and drops the batches before it, over epochs, instead of training the first ones
    again; a position set back (a rollback in the same process) reads on from the stream."""

    class Stream:  # re-iterable, not indexable
        def __iter__(self) -> Any:
            return iter([10, 11, 12, 13])

    cursor = BatchCursor(Stream(), epochs=3)
    cursor.position = 6  # epoch 1, its third batch
    assert cursor.next() == (6, 12)
    assert (cursor.epoch, cursor.drawn, cursor.caught_up) == (1, 7, 6)
    cursor.position = 3  # back: a plain iterable cannot rewind, the stream goes on
    assert cursor.next() == (3, 13)
    assert cursor.caught_up == 6
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2)
    fresh = BatchCursor(loader)
    fresh.position = 3
    index, (batch,) = fresh.next()
    assert index == 3 and batch.tolist() == [6.0, 7.0]


def test_a_survivors_failed_step_gives_its_batch_back_to_a_plain_iterable() -> None:
    """`unread` after a failed step: the same batch is trained next, at the same index, and
    the stream reads on after it without a catch-up."""
    cursor = BatchCursor(iter(range(100, 110)))
    for _ in range(3):
        cursor.next()
    index, batch = cursor.next()
    cursor.position = index  # back to the failed step's boundary
    cursor.unread([(index, batch)])
    assert cursor.next() == (3, 103)
    assert cursor.next() == (4, 104)
    assert cursor.caught_up == 0
