"""The LoopGuard's own parts, without a framework: a step measured around a loop's hooks
(`LoopStep`), and the loop's batch position with the updates it dropped (`LoopCursor`)."""

from __future__ import annotations

import math
import time

import pytest
import torch

from remedy.integrations import _loop
from remedy.integrations._loop import LoopCursor, LoopStep


@pytest.fixture
def now(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The loop's clock, set by the test: `now[0]` is what `perf_counter` returns."""
    clock = [0.0]
    monkeypatch.setattr(_loop.time, "perf_counter", lambda: clock[0])
    return clock


def test_a_step_averages_its_forwards_losses_and_reads_the_norm_before_clipping() -> None:
    model = torch.nn.Linear(3, 1)
    step = LoopStep(list(model.parameters()))
    step.begin()
    assert math.isnan(step.loss)
    step.record_loss(torch.tensor([1.0, 3.0]))  # a tensor: its mean
    step.record_loss(4)
    step.record_loss("not a loss")  # ignored
    assert step.losses == [2.0, 4.0] and step.loss == 3.0
    model(torch.ones(2, 3)).sum().backward()
    norm = step.measure_grads()
    assert norm is not None and step.grad_norm == float(norm) > 0 and step.finite
    step.begin()  # the next step starts clean
    assert step.losses == [] and not step.dropped


def test_a_step_without_a_finite_loss_or_norm_is_not_finite() -> None:
    model = torch.nn.Linear(3, 1)
    step = LoopStep(list(model.parameters()))
    step.record_loss(float("nan"))
    model(torch.ones(1, 3)).sum().backward()
    step.measure_grads()
    assert not step.finite
    frozen = LoopStep([])  # no trainable parameter: no norm to read
    frozen.record_loss(1.0)
    assert frozen.measure_grads() is None and math.isnan(frozen.grad_norm) and not frozen.finite


def test_the_loaders_wait_runs_from_the_end_of_the_step_before() -> None:
    step = LoopStep([])
    step.fetched()
    assert step.loader_s == 0.0  # the first step: nothing to wait after
    step.ended()
    time.sleep(0.02)
    step.fetched()
    assert step.loader_s >= 0.015  # slept 0.02 s; a margin for the two clocks
    step.begin()
    assert step.elapsed_s < step.loader_s


def test_the_boundarys_own_work_is_not_the_loaders_wait(now: list[float]) -> None:
    """Between two steps of an untimed loop (HF's Trainer) the boundary's work (commands read,
    the group's agreement waiting for the latest peer, commands sent) is left out of the
    loader's wait: a rank waiting for its peer there is not starved of data."""
    step = LoopStep([])
    step.fetched()
    step.begin()
    now[0] = 1.0
    step.ended()  # step 0 ends at 1 s; the Trainer fetches until 1.5 s
    now[0] = 1.5
    step.boundary_took(2.0)  # the boundary then waits 2 s for a peer
    now[0] = 3.5
    step.fetched()
    assert step.loader_s == 0.5


def test_timed_fetches_are_the_loaders_wait_wherever_they_fall(now: list[float]) -> None:
    """Where the framework's fetches are timed (Lightning's), the loader's wait is their time:
    a fetch between steps, and one inside a step (a later micro-batch's), which the step's time
    leaves out. The rest of the time between steps (an evaluation, a save) is neither."""
    step = LoopStep([])
    step.fetched()
    step.begin()
    now[0] = 1.0
    step.ended()  # step 0 ends at 1 s; an evaluation runs until 3 s
    now[0] = 3.0
    step.fetch_began()
    now[0] = 5.0
    step.fetch_ended()  # the next batch took 2 s
    now[0] = 6.0
    step.fetched()
    step.begin()
    assert step.loader_s == 2.0
    now[0] = 7.0
    step.fetch_began()
    now[0] = 10.0
    step.fetch_ended()  # the step's second micro-batch took 3 s
    now[0] = 11.0
    assert (step.elapsed_s, step.loader_time_s) == (2.0, 5.0)
    step.ended()
    now[0] = 12.0
    step.fetched()
    assert step.loader_s == 0.0  # nothing fetched since: no wait


def test_the_cursor_drops_the_updates_asked_for_and_the_bad_ones() -> None:
    cursor = LoopCursor()
    cursor.advance()
    cursor.advance()
    assert cursor.skip_next(2) == [2, 3]  # the next two batches by position
    assert cursor.drop(2, bad=False) and cursor.drop(3, bad=True)  # asked for: dropped
    assert not cursor.drop(4, bad=False)  # none asked any more
    assert cursor.drop(5, bad=True)  # not finite: dropped, but not a skipped batch
    assert cursor.skipped_batches == [2, 3]
    assert cursor.skipped_updates == {2, 3, 5}
    cursor.rewound(3)  # a rollback to step 3 undoes the drops from there on
    assert cursor.skipped_updates == {2}
    assert cursor.skipped_batches == [2, 3]  # what a command skipped stays said
