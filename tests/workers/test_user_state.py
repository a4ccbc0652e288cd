"""The loop's own state and step: `guard.next_step`, `state=` objects through rollback, resume and adoption."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.gpt_model import GPT, GPTConfig, SyntheticCorpus, lm_loss
from remedy.rank import Command, Guard, GuardConfig, WorkerContext
from remedy.rank.chaos.faults import parse_chaos
from remedy.rank.exceptions import GuardConfigError, UserStateError
from remedy.rank.state import train_state
from remedy.rank.state.user_state import UserState
from remedy.rundir.writer import read_jsonl

# Tiny models: one intra-op thread (faster on 2 loaded cores; comparisons stay in-process).
pytestmark = pytest.mark.usefixtures("one_torch_thread")

CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16)
_ids = itertools.count()


class Counter:
    """A loop counter the loop bumps once per step it trains (Stateful)."""

    def __init__(self) -> None:
        self.n = 0
        self.fail = False

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.fail:
            raise RuntimeError("this loader is broken")
        self.n = int(state["n"])


def guarded(
    tmp_path: Path | None,
    max_steps: int,
    *,
    state: dict[str, Any] | None = None,
    resume_step: int | None = None,
    faults: list[dict[str, Any]] | None = None,
    **cfg: Any,
) -> tuple[Guard, Iterator[Any]]:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    corpus = SyntheticCorpus(vocab_size=32, block_size=16, batch_size=4, length=20_000, seed=0)
    ctx = WorkerContext(
        run_dir=tmp_path,
        resume_step=resume_step,
        faults=parse_chaos({"faults": faults or []}),
    )
    config = GuardConfig(**{"detectors": [], "snapshot_every": 5, "checkpoint_every": 0, **cfg})
    guard = Guard(model, opt, loss_fn=lm_loss, data=corpus, max_steps=max_steps,
                  config=config, context=ctx, state=state)  # fmt: skip
    return guard, iter(guard)


def train(guard: Guard, it: Iterator[Any], steps: int, counter: Counter | None = None) -> list[int]:
    """Train `steps` steps; the next_step read before each, checked against the step trained."""
    seen = []
    for _ in range(steps):
        batch = next(it)
        step = guard.next_step
        result = guard.step(batch)
        assert result.step == step
        if counter is not None:
            counter.n += 1
        seen.append(step)
    return seen


def rollback(anomaly_step: int, steps_back: int, skip: int = 0) -> Command:
    params = {"steps_back": steps_back, "skip_batches": skip}
    return Command(f"rb-{next(_ids)}", "rollback", params, 0, anomaly_step=anomaly_step)


def test_next_step_counts_from_zero_in_a_fresh_run() -> None:
    """Fresh run: inside the loop next_step is 0, 1, 2, ... and is the step each batch trains."""
    guard, it = guarded(None, 8)
    assert train(guard, it, 8) == list(range(8))
    guard.close()


def test_next_step_and_user_state_go_back_with_a_rollback() -> None:
    """A rollback to step 5 from step 9: next_step is 5, and the counter is what it was at step 5."""
    counter = Counter()
    guard, it = guarded(None, 14, state={"loop": counter})
    train(guard, it, 9, counter)
    assert counter.n == 9
    guard.submit(rollback(anomaly_step=8, steps_back=3))
    seen = train(guard, it, 9, counter)  # the boundary applies the rollback, then steps 5..13
    guard.close()
    assert guard.history[0].outcome == "applied", guard.history[0].detail
    assert seen == list(range(5, 14))
    assert counter.n == 14  # 5 restored + 9 trained: it counts logical steps, not executions


def test_registered_later_and_per_rank_state_is_restored_by_a_rollback() -> None:
    """`register_state(..., per_rank=True)` after construction is snapshotted and rolled back too."""
    counter = Counter()
    guard, it = guarded(None, 12)
    guard.register_state("mine", counter, per_rank=True)
    train(guard, it, 7, counter)
    guard.submit(rollback(anomaly_step=6, steps_back=1))
    train(guard, it, 1, counter)
    assert guard.next_step == 6 and counter.n == 6  # restored to 5, then step 5 trained
    guard.close()


def test_a_resume_from_a_checkpoint_restores_the_step_and_the_state(tmp_path: Path) -> None:
    """A fresh process resuming from the checkpoint of step 10 starts its loop at next_step 10,
    with the counter of step 10."""
    counter = Counter()
    guard, it = guarded(tmp_path, 12, state={"loop": counter}, checkpoint_every=5)
    train(guard, it, 12, counter)
    guard.close()
    again = Counter()
    guard2, it2 = guarded(tmp_path, 14, state={"loop": again}, resume_step=10, checkpoint_every=5)
    assert train(guard2, it2, 4, again) == [10, 11, 12, 13]
    assert again.n == 14
    guard2.close()
    assert guard2.summary["resumed"]["step"] == 10


def test_a_replacement_adopts_replicated_state_and_keeps_its_own_per_rank_state(
    tmp_path: Path,
) -> None:
    """Adopting a peer's state: next_step is the peer's step, the replicated counter is the
    peer's, the per-rank one comes from this rank's newest checkpoint (a survivor keeps its own)."""
    # The peer trains 13 steps, bumping both counters, with checkpoints at 5 and 10.
    shared, mine = Counter(), Counter()
    peer, it = guarded(tmp_path / "a", 20, state={"shared": shared}, checkpoint_every=5)
    peer.register_state("mine", mine, per_rank=True)
    for _ in range(13):
        peer.step(next(it))
        shared.n += 1
        mine.n += 100
    state = train_state.capture(peer)
    assert peer.checkpoints is not None
    peer.checkpoints.wait()
    # A fresh process of the same rank (same run directory) joins: it adopts the peer's state.
    fresh_shared, fresh_mine = Counter(), Counter()
    fresh, it2 = guarded(tmp_path / "a", 20, state={"shared": fresh_shared}, checkpoint_every=5)
    fresh.register_state("mine", fresh_mine, per_rank=True)
    train_state.adopt(fresh, state, joining=True)
    assert fresh.next_step == 13
    assert fresh_shared.n == 13  # replicated: the peer's
    assert fresh_mine.n == 1000  # per rank: its rank's checkpoint of step 10
    # A survivor adopting the same state keeps its own per-rank counter.
    surv_shared, surv_mine = Counter(), Counter()
    surv_mine.n = 7
    survivor, _ = guarded(None, 20, state={"shared": surv_shared})
    survivor.register_state("mine", surv_mine, per_rank=True)
    train_state.adopt(survivor, state)
    assert (survivor.next_step, surv_shared.n, surv_mine.n) == (13, 13, 7)
    assert train(fresh, it2, 1) == [13]
    for g in (peer, fresh, survivor):
        g.close()


@pytest.mark.parametrize(
    ("state", "named"),
    [({"best_val_loss": 1.5}, "best_val_loss"), ({"sampler": object()}, "sampler")],
)
def test_state_without_the_stateful_protocol_fails_at_construction(
    state: dict[str, Any], named: str
) -> None:
    """`state=` given an object without state_dict/load_state_dict: one line naming the key."""
    with pytest.raises(GuardConfigError) as err:
        guarded(None, 3, state=state)
    message = str(err.value)
    assert "\n" not in message
    assert f"state[{named!r}]" in message and "state_dict()" in message


def test_register_state_checks_at_once() -> None:
    """`register_state` with a plain value raises at the call, naming the name."""
    guard, _ = guarded(None, 3)
    with pytest.raises(GuardConfigError, match=r"state\['lr'\]"):
        guard.register_state("lr", 3e-4)
    guard.close()


def test_a_failing_load_leaves_every_object_as_it_was() -> None:
    """All or nothing: the second object's load raises, the first is given its state back."""
    a, b = Counter(), Counter()
    user = UserState({"a": a, "b": b})
    a.n, b.n = 1, 2
    saved = user.capture()
    a.n, b.n = 10, 20
    b.fail = True
    with pytest.raises(UserStateError, match="state 'b': load_state_dict raised RuntimeError"):
        user.load(saved)
    assert (a.n, b.n) == (10, 20)


ON_FAILURE_NEXT = """\
version: 1
name: rollback-then-cut
rules:
  - name: nan
    when: {anomaly: nonfinite_loss}
    do:
      - rollback: {steps_back: 3, skip_batches: 2}
        on_failure: next
      - shrink_lr: {factor: 0.5}
    max_fires: 1
"""


def test_a_raising_load_state_dict_fails_the_rollback_and_the_policy_goes_on(
    tmp_path: Path,
) -> None:
    """A NaN at step 8 asks for a rollback; the state's load_state_dict raises: the rollback's
    outcome is failed with the reason, nothing was restored, shrink_lr runs, the run completes."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(ON_FAILURE_NEXT)
    counter = Counter()
    counter.fail = True
    run = tmp_path / "run"
    guard, it = guarded(run, 14, state={"loop": counter}, policy=str(policy), detectors=None,
                        faults=[{"kind": "nan_loss", "at_step": 8}])  # fmt: skip
    for batch in it:
        guard.step(batch)
        counter.n += 1
    summary = guard.close()
    assert summary["status"] == "completed"
    assert summary["steps_completed"] == 14 == summary["steps_executed"]  # nothing rolled back
    assert counter.n == 14  # nothing lost
    decisions = {d["action"]: d for d in read_jsonl(run / "decisions.jsonl")}
    failed = decisions["rollback"]
    assert failed["outcome"] == "failed", failed
    assert "state 'loop': load_state_dict raised RuntimeError: this loader is broken" in str(failed)
    assert decisions["shrink_lr"]["outcome"] == "applied"
    assert guard.lr_scale == 0.5
