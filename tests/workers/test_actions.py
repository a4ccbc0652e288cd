"""Actions change the running job exactly as specified, at a step boundary."""

from __future__ import annotations

import copy
import itertools
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.gpt_model import GPT, GPTConfig, SyntheticCorpus, lm_loss
from remedy.protocol.reports import Limits, RankMark, validate_batch
from remedy.rank import Command, Guard, GuardConfig
from remedy.rank.actions import inprocess as actions_mod
from remedy.rank.exceptions import TransientActionError
from remedy.rank.state import saver as saver_mod

# Tiny models: one intra-op thread (2.7x faster than two here under load, same bits within a test).
pytestmark = pytest.mark.usefixtures("one_torch_thread")

CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32)
_ids = itertools.count()


def make_job(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, SyntheticCorpus]:
    torch.manual_seed(seed)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
    corpus = SyntheticCorpus(vocab_size=32, block_size=16, batch_size=4, length=20_000, seed=seed)
    return model, opt, sched, corpus


def plain_train(steps: int, seed: int = 0, clip: float | None = None) -> list[dict[str, Any]]:
    """Reference: an unguarded loop (clipping gradients at `clip` if given); the state after
    every step."""
    model, opt, sched, corpus = make_job(seed)
    states = [snapshot_state(model, opt, sched)]
    for i in range(steps):
        loss = lm_loss(model, corpus.batch(i))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        states.append(snapshot_state(model, opt, sched))
    return states


def snapshot_state(
    model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any
) -> dict[str, Any]:
    return {
        "model": copy.deepcopy(model.state_dict()),
        "opt": copy.deepcopy(opt.state_dict()["state"]),
        "lr": [g["lr"] for g in opt.param_groups],
        "epoch": sched.last_epoch,
    }


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for pid, st in a["opt"].items():
        for k, v in st.items():
            assert torch.equal(v, b["opt"][pid][k]), (pid, k)
    assert a["lr"] == b["lr"] and a["epoch"] == b["epoch"]


def guarded(
    max_steps: int, tmp_path: Path | None = None, **cfg: Any
) -> tuple[Guard, Iterator[Any]]:
    model, opt, sched, corpus = make_job()
    config = GuardConfig(snapshot_every=5, **cfg)
    guard = Guard(
        model,
        opt,
        loss_fn=lm_loss,
        data=corpus,
        scheduler=sched,
        max_steps=max_steps,
        config=config,
        run_dir=tmp_path,
    )
    return guard, iter(guard)


def train(guard: Guard, it: Iterator[Any], steps: int) -> None:
    for _ in range(steps):
        guard.step(next(it))


def command(action: str, anomaly_step: int = 0, **params: Any) -> Command:
    return Command(f"test-{next(_ids)}", action, params, apply_at_step=0, anomaly_step=anomaly_step)


def last_outcome(guard: Guard) -> Any:
    return guard.history[-1]


def test_guard_is_transparent() -> None:
    """Guarded training yields bitwise the same state as the plain loop."""
    ref = plain_train(12)
    guard, it = guarded(12)
    train(guard, it, 12)
    assert_same_state(snapshot_state(guard.model, guard.optimizer, guard.scheduler), ref[12])
    guard.close()


def test_grad_clip_is_torchs_clipping() -> None:
    """GuardConfig(grad_clip=...) reuses the Guard's gradient norm and clips exactly as
    torch.nn.utils.clip_grad_norm_ in a plain loop does (the clip binds: lr 1e-2, norms > 0.05)."""
    ref = plain_train(8, clip=0.05)
    guard, it = guarded(8, grad_clip=0.05)
    norms = [guard.step(next(it)).grad_norm for _ in range(8)]
    assert min(norms) > 0.05
    assert_same_state(snapshot_state(guard.model, guard.optimizer, guard.scheduler), ref[8])
    guard.close()


def test_rollback_restores_exact_state_and_replays_identically() -> None:
    """Rollback restores model, optimizer, scheduler and data position exactly; the replay is bitwise identical."""
    ref = plain_train(17)
    guard, it = guarded(40)
    train(guard, it, 16)
    guard.submit(command("rollback", anomaly_step=16, steps_back=5))
    batch = next(it)  # the boundary applies the rollback, then fetches batch 10 again
    outcome = last_outcome(guard)
    assert outcome.outcome == "applied", outcome.detail
    assert outcome.result["restored_step"] == 10 and outcome.result["skipped_batches"] == []
    assert guard.step_count == 10 and guard.cursor.position == 11
    assert_same_state(snapshot_state(guard.model, guard.optimizer, guard.scheduler), ref[10])
    guard.step(batch)
    train(guard, it, 6)
    assert_same_state(snapshot_state(guard.model, guard.optimizer, guard.scheduler), ref[17])
    guard.close()


def test_rollback_skips_the_batches_after_the_restore_point() -> None:
    """skip_batches=N skips exactly the N batch indices that follow the restored position."""
    guard, it = guarded(40)
    train(guard, it, 12)
    guard.submit(command("rollback", anomaly_step=12, steps_back=2, skip_batches=4))
    batch = next(it)
    outcome = last_outcome(guard)
    assert outcome.result["restored_step"] == 10
    assert outcome.result["skipped_batches"] == [10, 11, 12, 13]
    seen = [guard.executor.batch_index]
    for _ in range(3):
        guard.step(batch)
        batch = next(it)
        seen.append(guard.executor.batch_index)
    assert seen == [14, 15, 16, 17]
    guard.close()


def test_rollback_without_snapshot_fails_cleanly() -> None:
    """A rollback with nothing to restore is a failed outcome with a reason, not a crash."""
    guard, _ = guarded(5)
    guard.snapshots._ring.clear()
    outcome = actions_mod.apply_command(guard, command("rollback", anomaly_step=3, steps_back=1))
    assert outcome.outcome == "failed" and "no snapshot" in outcome.detail
    guard.close()


def test_shrink_lr_scales_the_schedule_keeping_its_shape() -> None:
    """After shrink_lr(0.5) every later LR is exactly half the unshrunk schedule's."""
    ref = plain_train(20)
    guard, it = guarded(20)
    train(guard, it, 8)
    guard.submit(command("shrink_lr", factor=0.5))
    lrs = []
    for _ in range(12):
        batch = next(it)
        lrs.append(guard.effective_lrs()[0])
        guard.step(batch)
    expected = [0.5 * ref[s]["lr"][0] for s in range(8, 20)]
    assert lrs == pytest.approx(expected, rel=1e-12)
    # The schedule itself is untouched: the cut is applied around each optimizer step.
    assert guard.scheduler.get_last_lr()[0] == pytest.approx(ref[20]["lr"][0], rel=1e-12)
    guard.close()


def test_shrink_lr_survives_a_later_rollback() -> None:
    """A rollback to a snapshot taken before an LR cut keeps the cut in force."""
    ref = plain_train(12)
    guard, it = guarded(40)
    train(guard, it, 12)
    guard.submit(command("shrink_lr", factor=0.25))
    guard.submit(command("rollback", anomaly_step=12, steps_back=2))
    next(it)
    assert guard.step_count == 10
    assert guard.effective_lrs()[0] == pytest.approx(0.25 * ref[10]["lr"][0], rel=1e-12)
    guard.close()


def test_shrink_lr_respects_floor() -> None:
    """The LR never goes below min_lr."""
    guard, it = guarded(20)
    train(guard, it, 2)
    guard.submit(command("shrink_lr", factor=0.001, min_lr=1e-3))
    next(it)
    assert guard.effective_lrs()[0] == pytest.approx(1e-3)
    guard.close()


def test_rescale_grad_scaler_sets_and_multiplies() -> None:
    """rescale_grad_scaler sets the scale, multiplies it, and changes growth settings."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(10)]

    def loss_fn(m: torch.nn.Module, b: Any) -> torch.Tensor:
        return torch.nn.functional.mse_loss(m(b[0]), b[1])

    guard = Guard(
        model,
        opt,
        loss_fn=loss_fn,
        data=data,
        scaler=scaler,
        max_steps=10,
        config=GuardConfig(amp_dtype=torch.float16),
    )
    it = iter(guard)
    guard.step(next(it))
    guard.submit(
        command("rescale_grad_scaler", scale=1024.0, growth_interval=7, backoff_factor=0.25)
    )
    next(it)
    assert last_outcome(guard).outcome == "applied"
    assert scaler.get_scale() == 1024.0
    assert scaler.get_growth_interval() == 7 and scaler.get_backoff_factor() == 0.25
    outcome = actions_mod.apply_command(guard, command("rescale_grad_scaler", factor=0.5))
    assert outcome.result["scale_after"] == 512.0
    guard.close()


def test_rescale_without_scaler_fails() -> None:
    """rescale_grad_scaler on a job without a GradScaler fails with a reason."""
    guard, _ = guarded(3)
    outcome = actions_mod.apply_command(guard, command("rescale_grad_scaler", scale=2.0))
    assert outcome.outcome == "failed" and "GradScaler" in outcome.detail
    guard.close()


def test_transient_failures_are_retried_within_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A transient failure is retried (tenacity) and succeeds; a persistent one fails after MAX_ATTEMPTS."""
    calls = {"n": 0}

    def flaky(guard: Guard, params: dict[str, Any], cmd: Command) -> dict[str, Any]:
        calls["n"] += 1
        if calls["n"] < params["succeed_on"]:
            raise TransientActionError("disk busy")
        return {"detail": "ok"}

    monkeypatch.setitem(actions_mod.APPLIERS, "flaky", flaky)
    monkeypatch.setattr(actions_mod, "RETRY_WAIT_S", (0.0, 0.0))
    guard, _ = guarded(3)
    ok = actions_mod.apply_command(guard, command("flaky", succeed_on=3))
    assert (ok.outcome, ok.attempts) == ("applied", 3)
    calls["n"] = 0
    bad = actions_mod.apply_command(guard, command("flaky", succeed_on=99))
    assert (bad.outcome, bad.attempts) == ("failed", actions_mod.MAX_ATTEMPTS)
    assert "disk busy" in bad.detail
    guard.close()


def test_checkpoint_now_writes_a_verified_checkpoint(tmp_path: Path) -> None:
    """checkpoint_now writes a durable checkpoint that loads back at the current step."""
    guard, it = guarded(20, tmp_path)
    train(guard, it, 7)
    outcome = actions_mod.apply_command(guard, command("checkpoint_now"))
    assert outcome.outcome == "applied"
    assert guard.checkpoints is not None
    assert guard.checkpoints.load_latest().step == 7
    guard.close()


def test_rollback_falls_back_to_disk_checkpoint(tmp_path: Path) -> None:
    """When the ring no longer reaches back far enough, rollback restores a durable checkpoint."""
    guard, it = guarded(60, tmp_path, snapshot_ring=2, checkpoint_every=10)
    train(guard, it, 35)
    assert guard.snapshots.steps() == [25, 30] or guard.snapshots.steps() == [30, 35]
    guard.submit(command("rollback", anomaly_step=35, steps_back=15))
    next(it)
    outcome = last_outcome(guard)
    assert outcome.outcome == "applied", outcome.detail
    assert (outcome.result["restored_step"], outcome.result["source"]) == (20, "disk")
    guard.close()


def test_skip_batches_action() -> None:
    """skip_batches skips the next N batches from the current position."""
    guard, it = guarded(20)
    train(guard, it, 3)
    guard.submit(command("skip_batches", count=2))
    next(it)
    assert last_outcome(guard).result["skipped_batches"] == [3, 4]
    assert guard.executor.batch_index == 5
    guard.close()


def test_nonfinite_loss_skips_the_optimizer_step() -> None:
    """A NaN loss never reaches the weights: the optimizer step is skipped at once."""
    from remedy.rank import WorkerContext  # noqa: PLC0415
    from remedy.rank.chaos.faults import parse_chaos  # noqa: PLC0415

    model, opt, sched, corpus = make_job()
    ctx = WorkerContext(faults=parse_chaos({"faults": [{"kind": "nan_loss", "at_step": 3}]}))
    guard = Guard(
        model, opt, loss_fn=lm_loss, data=corpus, scheduler=sched, max_steps=10, context=ctx
    )
    it = iter(guard)
    train(guard, it, 3)
    before = copy.deepcopy(model.state_dict())
    result = guard.step(next(it))
    assert result.optimizer_skipped and "nonfinite_loss" in result.events
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
        assert torch.isfinite(v).all()
    guard.close()


def test_recycled_snapshot_buffers_restore_exactly(tmp_path: Path) -> None:
    """With a full ring, new snapshots reuse the evicted one's buffers and still restore bitwise."""
    ref = plain_train(31)
    guard, it = guarded(60, tmp_path, snapshot_ring=2, checkpoint_every=10)
    train(guard, it, 20)
    assert guard.checkpoints is not None
    guard.checkpoints.wait()  # a snapshot under a checkpoint write is never recycled
    oldest = next(iter(guard.snapshots))
    buffers = {t.data_ptr() for t in oldest.model.values()}
    train(guard, it, 11)
    newest = list(guard.snapshots)[-1]
    assert newest.step == 30
    assert {t.data_ptr() for t in next(iter(guard.snapshots)).model.values()} == buffers or {
        t.data_ptr() for t in newest.model.values()
    } == buffers, "the evicted snapshot's buffers were reused"
    guard.submit(command("rollback", anomaly_step=31, steps_back=1))
    next(it)
    assert last_outcome(guard).result["restored_step"] == 30
    assert_same_state(snapshot_state(guard.model, guard.optimizer, guard.scheduler), ref[30])
    guard.close()


def test_snapshots_fill_the_ring_into_prefaulted_buffers() -> None:
    """While the ring fills, a helper thread prepares zero-filled buffers shaped like the newest
    snapshot; the next snapshot copies into them, and a rollback to it is still exact."""
    ref = plain_train(12)
    guard, it = guarded(40, snapshot_ring=6)  # snapshots every 5 steps
    train(guard, it, 6)  # snapshots at 0 and 5; buffers shaped like step 5's are on the way
    assert guard.saver.spare is not None
    spare = guard.saver.spare.result(timeout=30)
    assert all(not t.any() for t in spare.model.values())
    prepared = {t.data_ptr() for t in spare.model.values()}
    train(guard, it, 5)  # the boundary before step 10 snapshots into them
    at10 = list(guard.snapshots)[-1]
    assert at10.step == 10
    assert {t.data_ptr() for t in at10.model.values()} == prepared
    assert (
        guard.saver.spare is not None and guard.saver.spare is not spare
    )  # the next one is prepared
    guard.submit(command("rollback", anomaly_step=11, steps_back=1))
    next(it)
    assert last_outcome(guard).result["restored_step"] == 10
    assert_same_state(snapshot_state(guard.model, guard.optimizer, guard.scheduler), ref[10])
    guard.close()
    assert guard.saver.spare is None


def test_a_full_ring_prepares_no_buffers() -> None:
    """Once full, the ring recycles its evicted snapshot: no helper-thread buffers are made."""
    guard, it = guarded(40, snapshot_ring=2)
    train(guard, it, 16)  # snapshots at 0, 5, 10, 15: full since 5
    assert guard.snapshots.full and guard.saver.spare is None
    guard.close()


def test_snapshots_survive_failing_buffer_preparation(monkeypatch: pytest.MonkeyPatch) -> None:
    """If the helper thread cannot prepare buffers (host memory, say), snapshots go to fresh
    memory as before, training goes on, and no more buffers are tried."""
    calls = []

    def fail(like: Any) -> Any:
        calls.append(like.step)
        raise MemoryError("no host memory for the next snapshot")

    monkeypatch.setattr(saver_mod, "blank_snapshot", fail)
    ref = plain_train(12)
    guard, it = guarded(40, snapshot_ring=6)
    train(guard, it, 12)
    assert calls == [0]
    assert [s.step for s in guard.snapshots] == [0, 5, 10]
    guard.submit(command("rollback", anomaly_step=11, steps_back=1))
    next(it)
    assert_same_state(snapshot_state(guard.model, guard.optimizer, guard.scheduler), ref[10])
    guard.close()


def test_many_skipped_batches_go_as_ranges_the_supervisor_takes() -> None:
    """300 skipped batches (llm-pretrain's rollback): a count and ranges, an outcome small enough
    for the supervisor's report validation (a list of 300 indices was refused)."""
    guard, it = guarded(40)
    train(guard, it, 12)
    guard.cursor.skipped.update({40, 41})  # skipped before: the ranges go around them
    guard.submit(command("rollback", anomaly_step=12, steps_back=2, skip_batches=300))
    next(it)
    outcome = last_outcome(guard)
    assert outcome.result["skipped_count"] == 300
    assert "skipped_batches" not in outcome.result
    assert outcome.result["skipped_ranges"] == [[10, 39], [42, 311]]
    batch = {"rank": 0, "step": 11, "tick": 13, "outcomes": [outcome.to_dict()]}
    rejected: Counter[str] = Counter()
    report = validate_batch(batch, world_size=1, last=None, origin=RankMark(0, 0, 0.0), now=1.0,
                            limits=Limits(), rejected=rejected)  # fmt: skip
    assert report is not None and len(report.outcomes) == 1 and not rejected
    guard.close()
