"""Phases (`rank.loop.phases`): declared, measured and warm-up phases, their bounds, and the
detectors that judge waiting leaving a peer's phase out (pure, a Guard alone, real gloo ranks)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from remedy import Guard, GuardConfig
from remedy.rank.detectors import CollectiveSlowDetector, CollectiveTimer
from remedy.rank.detectors.testing import run_guarded, step_stats
from remedy.rank.loop.phases import BETWEEN, WARMUP_STEPS, PhaseClock
from tests.workers.ddp_pair import ddp_mlp, rank_batches
from tests.workers.fsdp_ranks import spawn_ranks


class FakeClock:
    """A monotonic clock a test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _clock(**kwargs: Any) -> tuple[PhaseClock, FakeClock]:
    fake = FakeClock()
    return PhaseClock(clock=fake, **kwargs), fake


# ------------------------------------------------------------------ PhaseClock
def test_a_declared_phase_is_the_status_and_an_overrun_is_kept_with_its_name() -> None:
    """Inside `phase("eval")` the status names it with its time and bound; nested phases show
    the innermost; one that lasted past its bound is an overrun, named, handed out once."""
    clock, fake = _clock(bound_s=60.0, bounds={"save": 5.0})
    clock.step_begins()
    clock.step_ends()
    with clock.phase("eval"):
        fake.now += 2.0
        assert clock.status() == {"name": "eval", "for_s": 2.0, "bound_s": 60.0}
        with clock.phase("save"):
            fake.now += 6.0
            assert clock.status() == {"name": "save", "for_s": 6.0, "bound_s": 5.0}
    assert clock.overruns()[0].name == "save"
    assert clock.overruns() == []
    with clock.phase("log", bound_s=0.5):
        fake.now += 1.0
    (over,) = clock.overruns()
    assert (over.name, over.seconds, over.bound_s) == ("log", 1.0, 0.5)


def test_the_time_between_steps_is_a_measured_phase() -> None:
    """Between two steps the status is the measured phase; inside a step there is none; the gap
    is what `step_begins` returns, and a gap past its bound is an overrun of `between_steps`."""
    clock, fake = _clock(bound_s=10.0)
    clock.step_begins()
    assert clock.status() is None
    fake.now += 0.1
    clock.step_ends()
    fake.now += 3.0
    assert clock.status() == {"name": BETWEEN, "for_s": 3.0, "bound_s": 10.0}
    assert clock.step_begins() == pytest.approx(3.0)
    assert clock.overruns() == []
    clock.step_ends()
    fake.now += 11.0
    clock.step_begins()
    assert [o.name for o in clock.overruns()] == [BETWEEN]


def test_a_declared_overrun_between_steps_is_reported_once_under_its_own_name() -> None:
    """An eval past its bound between two steps is one `eval` overrun, not a second one for
    the gap that holds it."""
    clock, fake = _clock(bound_s=1.0)
    clock.step_begins()
    clock.step_ends()
    with clock.phase("eval"):
        fake.now += 2.0
    clock.step_begins()
    assert [o.name for o in clock.overruns()] == ["eval"]


def test_the_first_steps_and_those_after_a_regroup_warm_up() -> None:
    """The first WARMUP_STEPS steps warm up; a re-formed group's first ones again."""
    clock, _ = _clock()
    seen = []
    for _ in range(WARMUP_STEPS + 2):
        clock.step_begins()
        seen.append(clock.warming)
        clock.step_ends()
    assert seen == [True] * WARMUP_STEPS + [False, False]
    clock.restart_warmup()
    clock.step_begins()
    assert clock.warming


def test_a_compile_in_a_step_makes_it_and_the_next_one_warm_up() -> None:
    """torch's compile callbacks (as dynamo runs them) mark the step that compiled and the one
    after it; a compile under way is the status."""
    from torch._dynamo.callback import (  # noqa: PLC0415 - dynamo is heavy: this test only
        CallbackArgs,
        CallbackTrigger,
        callback_handler,
    )

    clock, fake = _clock(warmup_steps=0)
    clock.watch_compiles()
    try:
        clock.step_begins()
        assert not clock.warming
        args = CallbackArgs(CallbackTrigger.DYNAMO, "test")
        callback_handler.run_start_callbacks(args)
        fake.now += 4.0
        assert clock.status() == {"name": "compile", "for_s": 4.0, "bound_s": 300.0}
        callback_handler.run_end_callbacks(args)
        assert clock.warming
        clock.step_ends()
        clock.step_begins()
        assert clock.warming  # the step after the compile
        clock.step_ends()
        clock.step_begins()
        assert not clock.warming
    finally:
        clock.close()
    assert clock._callbacks is None


def test_a_phase_needs_a_name() -> None:
    """`guard.phase("")` is a clear error, not a silent phase."""
    clock, _ = _clock()
    with pytest.raises(ValueError, match="a phase needs a name"), clock.phase(""):
        pass


# ------------------------------------------------------------------ collective_slow
def _timer(*seconds: float) -> CollectiveTimer:
    timer = CollectiveTimer()
    for d in seconds:
        timer.finish(time.perf_counter() - d)
    return timer


def test_collective_slow_leaves_out_the_wait_for_a_peers_phase() -> None:
    """A 3 s all-reduce that waited 2.9 s for a peer's eval is not slow; the same all-reduce
    with no peer in a phase is; a warm-up step is not judged."""
    det = CollectiveSlowDetector(_timer(3.0))
    assert det.observe(step_stats(10, extra={"phase_wait_s": 2.9})) == []
    det = CollectiveSlowDetector(_timer(3.0))
    (ev,) = det.observe(step_stats(10))
    assert ev.kind == "collective_slow"
    det = CollectiveSlowDetector(_timer(3.0))
    assert det.observe(step_stats(1, extra={"phase_warmup": True})) == []
    # A wait longer than the peer's phase by more than the threshold is still slow.
    det = CollectiveSlowDetector(_timer(6.0))
    (ev,) = det.observe(step_stats(10, extra={"phase_wait_s": 3.0}))
    assert ev.details["phase_wait_s"] == 3.0 and ev.value == pytest.approx(3.0, abs=0.05)


# ------------------------------------------------------------------ a Guard alone
def test_a_guard_reports_an_overrun_phase_and_measures_the_gap(tmp_path: Path) -> None:
    """Alone: `guard.phase("eval", bound_s=...)` past its bound is a `phase_overrun` naming
    `eval` with the next step; the gap before a step lands in its metrics as `phase_s`."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(6)]
    guard = Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
        data=data,
        max_steps=6,
        run_dir=tmp_path,
        config=GuardConfig(checkpoint_every=0),
    )
    results = []
    for batch in guard:
        if guard.next_step == 4:
            with guard.phase("eval", bound_s=0.05):
                time.sleep(0.1)
        results.append(guard.step(batch))
    guard.close()
    assert [r.events for r in results] == [[], [], [], [], ["phase_overrun"], []]
    (event,) = [
        json.loads(line) for line in (tmp_path / "anomalies.jsonl").read_text().splitlines()
    ]
    assert (event["kind"], event["step"], event["details"]["phase"]) == ("phase_overrun", 4, "eval")
    assert event["threshold"] == 0.05 and event["value"] >= 0.1
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert metrics[4]["phase_s"] >= 0.1
    assert "phase_wait_s" not in metrics[4]  # alone: nobody to wait for


# ------------------------------------------------------------------ real gloo ranks
EVAL_STEP = 5
EVAL_S = 1.0
LATE_STEP = 8


def _rank_main(rank: int, world: int, tmp: str, declare: bool) -> dict[str, Any]:
    """One DDP rank: rank 0 evaluates EVAL_S before step EVAL_STEP (between steps), and rank 1
    is late by EVAL_S *inside* step LATE_STEP (a slow rank, not a phase)."""
    model = ddp_mlp()

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor, int]) -> torch.Tensor:
        x, y, index = batch
        if rank == 1 and index == LATE_STEP:
            time.sleep(EVAL_S)
        return nn.functional.mse_loss(m(x), y)

    def before_step(guard: Guard) -> None:
        if rank == 0 and guard.next_step == EVAL_STEP:
            with guard.phase("eval") if declare else contextlib.nullcontext():
                end = time.perf_counter() + EVAL_S
                with torch.no_grad():
                    while time.perf_counter() < end:
                        model.module(torch.randn(64, 16))

    run = run_guarded(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        loss_fn=loss_fn,
        data=rank_batches(rank, 12),
        steps=11,
        detectors=[CollectiveSlowDetector(threshold_s=0.5)],
        policy_dir=tmp,
        snapshot_every=1000,
        before_step=before_step,
    )
    return {
        "events": [[e.kind, e.step] for e in run.events],
        "phase_wait_s": [s.extra.get("phase_wait_s") for s in run.stats],
        "phase_s": [s.extra.get("phase_s") for s in run.stats],
    }


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "declare", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["measured", "declared"]
)
def test_a_peer_waiting_for_rank_0s_eval_is_not_slow_but_a_late_rank_still_is(
    tmp_path: Path, declare: bool
) -> None:
    """Two real gloo DDP ranks: rank 1 waits ~1 s for rank 0's eval before step 5 (measured, or
    declared with guard.phase): no collective_slow, and rank 1's metrics say it waited for a
    phase; rank 1 late by 1 s inside step 8 is still rank 0's collective_slow."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    r0, r1 = spawn_ranks(_rank_main, 2, tmp_path, str(tmp_path), declare)
    assert r0["events"] == [["collective_slow", LATE_STEP]], r0
    assert r1["events"] == [], r1
    assert r0["phase_s"][EVAL_STEP] >= EVAL_S
    assert r1["phase_wait_s"][EVAL_STEP] >= EVAL_S * 0.8
    assert r0["phase_wait_s"][EVAL_STEP] is None
