"""The Guard's durable checkpoints: cadence as configured, retirement on rollback, resume, corrupt fallback."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.gpt_model import GPT, GPTConfig, SyntheticCorpus, lm_loss
from remedy.rank import Command, Guard, GuardConfig, WorkerContext
from remedy.rank.chaos.faults import corrupt_file
from remedy.rundir.writer import read_jsonl

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16)
_ids = itertools.count()


def guarded(
    tmp_path: Path, max_steps: int, *, resume_step: int | None = None, **cfg: Any
) -> tuple[Guard, Iterator[Any]]:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
    corpus = SyntheticCorpus(vocab_size=32, block_size=16, batch_size=4, length=20_000, seed=0)
    ctx = WorkerContext(run_dir=tmp_path, resume_step=resume_step)
    guard = Guard(
        model,
        opt,
        loss_fn=lm_loss,
        data=corpus,
        scheduler=sched,
        max_steps=max_steps,
        config=GuardConfig(detectors=[], **cfg),
        context=ctx,
    )
    return guard, iter(guard)


def train(guard: Guard, it: Iterator[Any], steps: int) -> None:
    for _ in range(steps):
        guard.step(next(it))


def command(action: str, anomaly_step: int = 0, **params: Any) -> Command:
    return Command(f"t-{next(_ids)}", action, params, apply_at_step=0, anomaly_step=anomaly_step)


def disk_steps(tmp_path: Path, rank: int = 0) -> list[int]:
    names = (tmp_path / "checkpoints").glob(f"step-*.rank{rank}.json")
    return sorted(int(p.name[5:13]) for p in names)


def test_checkpoint_every_is_honoured_off_the_snapshot_cadence(tmp_path: Path) -> None:
    """checkpoint_every=15 with snapshots every 10 writes checkpoints at 0, 15 and 30."""
    guard, it = guarded(tmp_path, 40, snapshot_every=10, checkpoint_every=15, checkpoint_keep=10)
    train(guard, it, 40)
    guard.close()
    assert disk_steps(tmp_path) == [0, 15, 30]


def test_rollback_retires_newer_checkpoints(tmp_path: Path) -> None:
    """A rollback to step 10 retires the checkpoints of steps 15, 20 and 25: a resume never lands on them."""
    guard, it = guarded(tmp_path, 60, snapshot_every=5, checkpoint_every=5, checkpoint_keep=10)
    train(guard, it, 27)
    assert guard.checkpoints is not None
    guard.checkpoints.wait()  # written in the background
    assert disk_steps(tmp_path) == [0, 5, 10, 15, 20, 25]
    guard.submit(command("rollback", anomaly_step=27, steps_back=17))
    next(it)
    outcome = guard.history[-1]
    assert outcome.outcome == "applied", outcome.detail
    assert outcome.result["restored_step"] == 10
    assert outcome.result["retired_checkpoints"] == [15, 20, 25]
    assert "retired the checkpoints of steps 15, 20, 25" in outcome.detail
    assert disk_steps(tmp_path) == [0, 5, 10]
    guard.close()


def test_resume_continues_exactly_with_remediations(tmp_path: Path) -> None:
    """A fresh Guard resumed from step 10 ends bitwise equal to the run that wrote it, LR cut included."""
    first, it = guarded(tmp_path, 20, snapshot_every=5, checkpoint_every=10, checkpoint_keep=5)
    train(first, it, 4)
    first.submit(command("shrink_lr", factor=0.5))
    train(first, it, 16)
    first.close()
    expected = {k: v.clone() for k, v in first.model.state_dict().items()}
    second, it2 = guarded(tmp_path, 20, resume_step=10, snapshot_every=5, checkpoint_every=10)
    for batch in it2:
        second.step(batch)
    assert second.resumed is not None and second.resumed["step"] == 10
    assert second.lr_scale == 0.5
    assert second.tick == first.tick
    for k, v in second.model.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_resume_falls_back_past_a_corrupt_checkpoint(tmp_path: Path) -> None:
    """Resuming from a checkpoint that fails its checksum uses the previous one and reports checkpoint_corrupt."""
    first, it = guarded(tmp_path, 20, snapshot_every=5, checkpoint_every=5, checkpoint_keep=5)
    train(first, it, 20)
    first.close()
    corrupt_file(tmp_path / "checkpoints" / "step-00000015.rank0.pt")
    second, it2 = guarded(tmp_path, 20, resume_step=15, snapshot_every=5, checkpoint_every=5)
    next(it2)
    assert second.resumed is not None
    assert second.resumed["step"] == 10
    assert "step 15 failed its checksum on rank 0" in second.resumed["why"]
    second.close()
    kinds = [(e["kind"], e["details"]["checkpoint_step"]) for e in read_jsonl(
        tmp_path / "anomalies.jsonl") if e["kind"] == "checkpoint_corrupt"]  # fmt: skip
    assert kinds == [("checkpoint_corrupt", 15)]


def test_corrupt_checkpoint_fault_flips_the_newest_payload_once(tmp_path: Path) -> None:
    """corrupt_checkpoint at step 12 breaks the checksum of checkpoint 10 only, and fires once per run."""
    from remedy.rank.chaos.faults import parse_chaos  # noqa: PLC0415

    guard, it = guarded(tmp_path, 30, snapshot_every=5, checkpoint_every=5, checkpoint_keep=10)
    guard.injector = type(guard.injector)(
        parse_chaos({"faults": [{"kind": "corrupt_checkpoint", "at_step": 12, "rank": 0}]}),
        0,
        run_dir=tmp_path,
    )
    train(guard, it, 30)
    guard.close()
    assert guard.checkpoints is not None
    assert guard.checkpoints.verified_steps() == [0, 5, 15, 20, 25]
    fired = list((tmp_path / "chaos" / "fired").glob("corrupt_checkpoint-*.json"))
    assert len(fired) == 1


def test_resume_with_no_good_checkpoint_starts_from_the_initial_state(tmp_path: Path) -> None:
    """Every checkpoint failing its checksum: the rank keeps its initial state, says why, retires them."""
    first, it = guarded(tmp_path, 10, snapshot_every=5, checkpoint_every=5, checkpoint_keep=5)
    train(first, it, 10)
    first.close()
    for path in (tmp_path / "checkpoints").glob("step-*.pt"):
        corrupt_file(path)
    second, it2 = guarded(tmp_path, 10, resume_step=10, snapshot_every=5, checkpoint_every=5)
    initial = {k: v.clone() for k, v in second.model.state_dict().items()}
    next(it2)
    assert second.resumed is not None and second.resumed["step"] == 0
    assert second.resumed["why"].endswith("starting from the initial state")
    assert second.step_count == 0
    for k, v in second.model.state_dict().items():
        assert torch.equal(v, initial[k]), k
    second.close()
