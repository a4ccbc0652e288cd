"""collective_slow from a real two-rank gloo DDP job with a late rank; straggler verdicts as pure
functions of step times."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from remedy.control.straggler import StragglerWatch, find_stragglers
from remedy.rank.detectors import (
    CollectiveSlowDetector,
    CollectiveTimer,
    install_collective_timer,
)
from remedy.rank.detectors.testing import run_guarded, step_stats
from tests.workers.ddp_pair import ddp_mlp, rank_batches
from tests.workers.fsdp_ranks import spawn_ranks

LATE_STEP = 4
LATE_S = 1.0


def _rank_main(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """One DDP rank: rank 1 is late for step LATE_STEP's all-reduce by LATE_S seconds."""
    model = ddp_mlp()
    timer = install_collective_timer(model)

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor, int]) -> torch.Tensor:
        x, y, index = batch
        if index == 0:
            dist.barrier()  # ranks start the first step together, however long their setup took
        if rank == 1 and index == LATE_STEP:
            time.sleep(LATE_S)  # a slow rank: the others wait in the all-reduce
        return nn.functional.mse_loss(m(x), y)

    run = run_guarded(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        loss_fn=loss_fn,
        data=rank_batches(rank, 10),
        steps=8,
        detectors=[CollectiveSlowDetector(timer, threshold_s=0.5)],
        policy_dir=tmp,
        snapshot_every=1000,
    )
    return {
        "events": [(e.kind, e.step, e.value) for e in run.events],
        "collective_s": [s.extra.get("collective_s") for s in run.stats],
        "count": timer.count,
    }


@pytest.mark.timeout(180)
def test_late_rank_makes_real_allreduce_slow(tmp_path: Path) -> None:
    """Rank 1 arrives 1 s late at step 4: rank 0's timed all-reduce takes ~1 s, collective_slow
    fires there on rank 0 only, and every step's collective time lands in the metrics."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    r0, r1 = spawn_ranks(_rank_main, 2, tmp_path, str(tmp_path))
    assert [(k, s) for k, s, _ in r0["events"]] == [("collective_slow", LATE_STEP)], r0
    assert LATE_S * 0.8 < r0["events"][0][2] < LATE_S * 3
    assert r1["events"] == []
    assert r0["count"] >= 8 and all(c is not None for c in r0["collective_s"])


def _attach_main(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """A one-rank DDP job: the Guard gives a timer-less detector a timer; an existing hook wins."""
    out: dict[str, Any] = {}
    for case in ("plain", "own_hook"):
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
        if case == "own_hook":
            model.register_comm_hook(None, _own_hook)
        detector = CollectiveSlowDetector()
        data = [(torch.randn(8, 4), torch.randn(8, 1), i) for i in range(4)]
        run = run_guarded(
            model,
            torch.optim.SGD(model.parameters(), lr=0.01),
            loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
            data=data,
            steps=3,
            detectors=[detector],
            policy_dir=tmp,
        )
        out[case] = {
            "timed": detector.timer is not None,
            "collective_s": [s.extra.get("collective_s") for s in run.stats],
        }
    return out


def _own_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


_own_hook.__annotations__ = {  # DDP checks the annotations as objects (this module has PEP 563)
    "state": object,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


@pytest.mark.timeout(120)
def test_guard_times_a_ddp_models_allreduces(tmp_path: Path) -> None:
    """A CollectiveSlowDetector without a timer is given one on a DDP model, so every step's
    collective time reaches the metrics; with the user's own comm hook registered, timing
    stays off and training goes on."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    [out] = spawn_ranks(_attach_main, 1, tmp_path, str(tmp_path))
    assert out["plain"]["timed"]
    assert all(isinstance(c, float) for c in out["plain"]["collective_s"])
    assert out["own_hook"] == {"timed": False, "collective_s": [None, None, None]}


def test_timer_collects_once_and_detector_flags_slowest() -> None:
    """Finished timings are handed out once; one above the threshold is an event."""
    timer = CollectiveTimer()
    for d in (0.1, 2.5):
        start = time.perf_counter() - d
        timer.finish(start)
    det = CollectiveSlowDetector(timer)
    s = step_stats(7)
    (ev,) = det.observe(s)
    assert ev.kind == "collective_slow" and ev.value == pytest.approx(2.5, abs=0.05)
    assert s.extra["collective_s"] == pytest.approx(2.6, abs=0.05)
    assert det.observe(step_stats(8)) == []


def test_collective_detector_without_timer_is_silent() -> None:
    """No timer installed (single-process jobs): nothing to read, nothing reported."""
    assert CollectiveSlowDetector().observe(step_stats(0)) == []


# ------------------------------------------------------------------ stragglers
@pytest.mark.parametrize(
    ("times", "slow"),
    [
        ({0: [1.0] * 10, 1: [1.0] * 10, 2: [2.0] * 10}, {2}),
        ({0: [1.0] * 10, 1: [1.6] * 10}, {1}),
        ({0: [1.0] * 10, 1: [1.1] * 10, 2: [1.2] * 10}, set()),
        ({0: [0.01] * 10, 1: [0.03] * 10}, set()),  # 3x, but only 20 ms: noise, not a straggler
        ({0: [1.0] * 10, 1: [1.0] * 4 + [9.0]}, set()),  # too few samples from rank 1
        ({0: [1.0] * 10}, set()),
        ({0: [1.0] * 19 + [30.0], 1: [1.0] * 20}, set()),  # one slow step is not a straggler
    ],
)
def test_find_stragglers(times: dict[int, list[float]], slow: set[int]) -> None:
    """A rank is a straggler when its median step time exceeds its peers' by 1.5x and 50 ms."""
    assert set(find_stragglers(times)) == slow


def test_straggler_watch_needs_persistence_and_cools_down() -> None:
    """Reported after 3 slow checks in a row, once per episode; a quick recovery resets."""
    watch = StragglerWatch(patience=3, cooldown_checks=5)
    slow = {0: [1.0] * 10, 1: [1.0] * 10, 2: [3.0] * 10}
    calm = {r: [1.0] * 10 for r in range(3)}
    got = [watch.check(slow, step=i) for i in range(2)] + [watch.check(calm, step=2)]
    assert all(g == [] for g in got)
    got = [watch.check(slow, step=3 + i) for i in range(6)]
    reported = [(e.rank, e.step, e.source) for g in got for e in g]
    assert reported == [(2, 5, "supervisor")]
    assert got[2][0].details["peer_median_s"] == 1.0


def _stragglers_pairwise(
    times: dict[int, list[float]], window: int = 20, min_samples: int = 5
) -> dict[int, tuple[float, float]]:
    """The definition, rank by rank: each median against the median of all the others'."""
    medians = {r: statistics.median(t[-window:]) for r, t in times.items() if len(t) >= min_samples}
    out = {}
    for rank, mine in medians.items():
        others = [m for r, m in medians.items() if r != rank]
        if not others:
            return {}
        reference = statistics.median(others)
        if mine > 1.5 * reference and mine - reference > 0.05:
            out[rank] = (mine, reference)
    return out


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.integers(0, 64),
        st.lists(st.sampled_from([0.01, 0.1, 0.1, 0.12, 0.2, 0.5, 1.0, 3.0]), max_size=25),
        max_size=40,
    )
)
def test_find_stragglers_matches_pairwise_definition(times: dict[int, list[float]]) -> None:
    """Sorting the medians once gives exactly the verdicts and references of comparing each
    rank with every other (ties and even counts included)."""
    assert find_stragglers(times) == _stragglers_pairwise(times)
