"""Slow collectives: timing DDP's gradient all-reduces and flagging the slow ones.

`install_collective_timer(ddp_model)` registers a DDP communication hook
that does what DDP does by default (average each gradient bucket with one
all-reduce) and times each all-reduce from the moment the bucket is handed
to the backend until its future completes. On CPU backends (gloo) that is
wall-clock time; on CUDA it is measured with CUDA events recorded on the
stream, so timing adds no host synchronisation. Either way the time includes
waiting for the slowest rank to join, which is what a slow collective costs.

`CollectiveSlowDetector(timer)` reads the finished timings once per step,
raises `collective_slow` when one all-reduce took longer than
`threshold_s`, and records the step's total collective time in
`stats.extra["collective_s"]` (it reaches `metrics.jsonl`), so the
supervisor can tell time spent computing from time spent waiting.

Waiting for a peer's phase is not slow (`rank.loop.phases`): the time this
rank waited for a peer that evaluated, saved or logged before the step
(`phase_wait_s`, from the Guard's phase exchange) is taken off the slowest
all-reduce before it is judged, and a warm-up step (`phase_warmup`: the first
steps after a start or a regroup, a compile, on any rank) is not judged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch
import torch.distributed as dist

from remedy.policies import AnomalyEvent
from remedy.rank.detectors._robust import Cooldown
from remedy.rank.detectors.base import event
from remedy.rank.loop.stats import StepStats

log = structlog.get_logger("remedy.detectors")

CommHook = Callable[[Any, "dist.GradBucket"], "torch.futures.Future[torch.Tensor]"]


class CollectiveTimer:
    """Start/finish marks of timed collectives; `collect()` returns finished durations."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: list[tuple[Any, Any]] = []  # (start, end) marks; end None until done
        self.count = 0

    def start(self, like: torch.Tensor) -> Any:
        if like.is_cuda:
            mark = torch.cuda.Event(enable_timing=True)
            mark.record()
            return mark
        return time.perf_counter()

    def finish(self, start: Any) -> None:
        if isinstance(start, float):
            end: Any = time.perf_counter()
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        with self._lock:
            self._open.append((start, end))
            self.count += 1

    def collect(self) -> list[float]:
        """Durations in seconds of the collectives finished since the last call."""
        with self._lock:
            marks, self._open = self._open, []
        out: list[float] = []
        waiting: list[tuple[Any, Any]] = []
        for start, end in marks:
            if isinstance(start, float):
                out.append(end - start)
            elif end.query():
                out.append(start.elapsed_time(end) / 1000.0)
            else:
                waiting.append((start, end))  # still on the stream: next time
        if waiting:
            with self._lock:
                self._open[:0] = waiting
        return out


def _allreduce_mean(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default: average the bucket across the group with one all-reduce."""
    pg = group if group is not None else dist.group.WORLD
    tensor = bucket.buffer()
    tensor.div_(dist.get_world_size(pg))
    fut = dist.all_reduce(tensor, group=pg, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def install_collective_timer(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    *,
    process_group: Any = None,
    hook: CommHook | None = None,
    timer: CollectiveTimer | None = None,
) -> CollectiveTimer:
    """Register a timed all-reduce comm hook on `ddp_model`; return its timer.

    `hook` is the communication to time (default: DDP's plain averaging
    all-reduce); DDP accepts one hook per model, so pass yours here rather
    than registering it yourself.
    """
    inner = hook or _allreduce_mean
    clock = timer or CollectiveTimer()

    def timed(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        start = clock.start(bucket.buffer())

        def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            clock.finish(start)
            return fut.value()

        return inner(state, bucket).then(done)

    # DDP checks the hook's annotations as objects; this module's are strings (PEP 563).
    timed.__annotations__ = {
        "state": object,
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    ddp_model.register_comm_hook(process_group, timed)
    return clock


@dataclass
class CollectiveSlowDetector:
    """`collective_slow`: one all-reduce took longer than `threshold_s`."""

    timer: CollectiveTimer | None = None
    threshold_s: float = 2.0
    cooldown_steps: int = 50
    name: str = "collective_slow"
    _cooldown: Cooldown = field(init=False)

    def __post_init__(self) -> None:
        self._cooldown = Cooldown(self.cooldown_steps)

    def attach(self, model: torch.nn.Module) -> None:
        """Time `model`'s all-reduces if it is a DDP model and no timer was given.

        The Guard calls this with its model. DDP takes one communication hook
        per model: if one is registered already, timing stays off (pass
        `install_collective_timer(model, hook=yours)` as the timer to have both).
        """
        if self.timer is not None or not isinstance(
            model, torch.nn.parallel.DistributedDataParallel
        ):
            return
        try:
            self.timer = install_collective_timer(model)
        except RuntimeError as exc:  # a hook is registered already
            log.info("collective timing off", reason=str(exc).splitlines()[0])

    def observe(self, stats: StepStats) -> list[AnomalyEvent]:
        if self.timer is None:
            return []
        durations = self.timer.collect()
        if not durations:
            return []
        stats.extra["collective_s"] = round(sum(durations), 6)
        if stats.extra.get("phase_warmup"):
            return []
        # The wait for a peer's own phase before this step is not the collective's.
        waited = float(stats.extra.get("phase_wait_s", 0.0))
        slowest = max(max(durations) - waited, 0.0)
        if slowest <= self.threshold_s or not self._cooldown.ready(stats.tick):
            return []
        self._cooldown.fire(stats.tick)
        return [
            event(
                stats,
                "collective_slow",
                value=slowest,
                threshold=self.threshold_s,
                severity="critical" if slowest > 5 * self.threshold_s else "warning",
                collectives=len(durations),
                total_s=round(sum(durations), 6),
                **({"phase_wait_s": round(waited, 6)} if waited else {}),
            )
        ]

    def reset(self) -> None:
        """Timings of the abandoned steps say nothing about the restored ones."""
        if self.timer is not None:
            self.timer.collect()
