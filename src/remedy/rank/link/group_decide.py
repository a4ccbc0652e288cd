"""A process group without a supervisor decides once: rank 0 runs the policy for every rank.

Under torchrun, Ray Train or a plain `mp.spawn` there is no remedy supervisor
to merge what the ranks see. A NaN loss on one rank is a NaN gradient on
every rank after DDP's all-reduce; decided apart, one rank would roll back
while another cut its LR, and their collectives would part ways. So the
group decides once, the way `remedy run`'s supervisor does:

- rank 0 holds the one `Controller`: it ingests its own reports as they are
  made (its metrics go to `metrics.jsonl`, its anomalies to the journal);
- the other ranks keep their reports (events, outcomes, the newest step and
  tick) until the group exchanges them, and write their step records to
  `metrics-rank-<r>.jsonl` themselves;
- the per-step agreement the Guard already all-reduces carries one more
  number, whether any rank has news (`Agreement.news`). Only then,
  at the next boundary, does every rank take part in an exchange: one
  `all_gather_object` brings every rank's reports to rank 0, which merges
  the anomalies of one executed step into one incident (`IncidentMerger`)
  and decides, and one `broadcast_object_list` brings the commands back.
  Every rank then holds the same commands, which the agreement applies at
  the same boundary on every rank. A clean step costs nothing more.
- at the end every rank's summary goes to rank 0, which writes
  `summary.json` with every rank's totals.

The exchanges run on the training group itself (its timeout bounds them, as
it bounds DDP's own collectives). A group of their own (`dist.new_group`)
would find its peers' addresses of the previous attempt in the store after
torchrun restarted the group (seen with torch 2.13: every new group of the
second attempt failed with "connection refused").
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any, Protocol

import structlog
import torch.distributed as dist

from remedy.rank.group.launched import LaunchedGroup
from remedy.rank.group.membership import COLLECTIVE_TIMEOUT_ENV, collective_timeout
from remedy.rank.link import launcher
from remedy.rundir.journal_effects import write_journal

if TYPE_CHECKING:
    from remedy.control.decide import Controller
    from remedy.policies import Engine
    from remedy.rank.link.context import WorkerContext
    from remedy.rank.link.inbox import Agreement
    from remedy.rundir.writer import RunDir

log = structlog.get_logger("remedy.group_decide")

# The parts of a report that accumulate between exchanges; the rest is its header.
_BODY = ("events", "outcomes", "metrics")


def rank_metrics_file(rank: int) -> str:
    """The file of step records that rank `rank` (not 0) writes itself."""
    return f"metrics-rank-{rank}.jsonl"


def merge(held: dict[str, Any] | None, batch: dict[str, Any]) -> dict[str, Any]:
    """`batch` added to the report `held` since the last exchange: the newest header, every
    event and outcome (its step records are written by the rank itself, never carried)."""
    if held is None:
        held = {"events": [], "outcomes": [], "metrics": []}
    held.update({k: v for k, v in batch.items() if k not in _BODY})
    held["events"].extend(batch.get("events") or [])
    held["outcomes"].extend(batch.get("outcomes") or [])
    return held


class GroupReporter:
    """The reporter of one rank of a group that decides without a supervisor."""

    def __init__(
        self,
        controller: Controller | None,
        *,
        rank: int,
        world_size: int,
        group: Any,
        run_dir: RunDir | None = None,
        launcher: str = "a launcher",
    ) -> None:
        """`controller`: rank 0's, the group's only one (None on every other rank); `group`: the
        process group the exchanges run on; `run_dir`: where this rank writes (None: nowhere)."""
        if (controller is None) != (rank != 0):
            raise ValueError("rank 0, and only rank 0, holds the group's controller")
        self.controller = controller
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.run_dir = run_dir
        self.launcher = launcher
        self._held: dict[str, Any] | None = None  # this rank's reports since the last exchange
        self._header: dict[str, Any] | None = None  # rank, step and tick of the newest report
        self._news = False
        # Rank 0: the commands each exchange delivered (a decision taken since is news).
        self._delivered: set[str] = set()
        self._started = time.time()
        self.exchanges = 0  # exchanges this rank took part in
        self.lost: str | None = None  # why the group is lost (`peer_lost`), if it is

    # --------------------------------------------------------------- reports
    def send(self, batch: dict[str, Any], *, wait: bool = False) -> None:
        """Take one report: rank 0 ingests it now; the others keep it for the next exchange."""
        del wait  # nobody answers outside an exchange (an OOM's answer comes with the next one)
        self._header = {k: batch[k] for k in ("rank", "step", "tick") if k in batch}
        if batch.get("events") or batch.get("outcomes"):
            self._news = True
        if self.controller is not None:
            self.controller.ingest(batch, now=time.time(), answer=False)
            write_journal(self.run_dir, self.controller.take_effects())
            return
        records = batch.get("metrics") or []
        if records and self.run_dir is not None:
            self.run_dir.metrics_many(records, name=rank_metrics_file(self.rank))
        self._held = merge(self._held, batch)

    def poll(self) -> list[dict[str, Any]]:
        """Commands come only with an exchange (`exchange`), never between them."""
        return []

    @property
    def has_news(self) -> bool:
        """Whether this rank has something for the group's decider: an anomaly or an outcome
        not yet exchanged; on rank 0 also a decision not yet delivered, or an incident held."""
        if self._news:
            return True
        c = self.controller
        return c is not None and (c.incidents.holding > 0 or not set(c.pending) <= self._delivered)

    def exchange(self) -> list[dict[str, Any]]:
        """Every rank, at the same boundary: reports to rank 0, its commands back to every rank.

        Returns the commands this rank owes (the same on every rank but for outcomes
        already reported). Raises what the collectives raise (a lost peer).
        """
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, self._outgoing(), group=self.group)
        reply: dict[int, list[dict[str, Any]]] | None = None
        if self.controller is not None:
            self._ingest(gathered)
            reply = self.controller.commands_for_ranks(range(self.world_size))
            self._delivered = set(self.controller.pending)
        box: list[Any] = [reply]
        dist.broadcast_object_list(box, src=0, group=self.group)
        self._held, self._news = None, False
        self.exchanges += 1
        return list(box[0][self.rank])

    def _outgoing(self) -> dict[str, Any] | None:
        """What this rank brings to an exchange: its reports, or its header alone (the merger
        learns from it that the rank has finished a step); rank 0 brings nothing."""
        if self.controller is not None:
            return None
        if self._held is not None:
            return self._held
        if self._header is None:
            return None
        return {**self._header, "ts": time.time(), "events": [], "outcomes": [], "metrics": []}

    def _ingest(self, gathered: list[Any]) -> None:
        assert self.controller is not None
        for batch in gathered:
            if batch is not None:
                self.controller.ingest(batch, now=time.time(), write_metrics=False, answer=False)
        write_journal(self.run_dir, self.controller.take_effects())

    def peer_lost(self, reason: str) -> None:
        """A collective failed: the group is lost; `close` makes no collective of its own."""
        self.lost = reason

    # ------------------------------------------------------------------- end
    def close(self, rank_summary: dict[str, Any] | None = None) -> None:
        """Every rank, at the end: the last reports and every rank's summary go to rank 0, which
        resolves what is pending and writes summary.json."""
        gathered: list[Any] = [None] * self.world_size
        if self.lost is None:
            try:
                dist.all_gather_object(gathered, (self._outgoing(), rank_summary), group=self.group)
            except RuntimeError as exc:  # a peer lost at the very end
                self.lost = f"the last exchange failed: {str(exc)[:200]}"
        if self.lost is not None:
            gathered = [None] * self.world_size
            gathered[self.rank] = (None, rank_summary)
        if self.controller is not None:
            self._ingest([g[0] for g in gathered if g is not None])
            summaries = [g[1] for g in gathered if g is not None and g[1] is not None]
            self._write_summary(summaries)
        if self.run_dir is not None:
            self.run_dir.close()

    def _write_summary(self, ranks: list[dict[str, Any]]) -> None:
        from remedy.rank.guard import _local_summary  # noqa: PLC0415 - the Guard imports this

        c = self.controller
        assert c is not None
        c.finish()
        write_journal(self.run_dir, c.take_effects())
        if self.run_dir is None or not ranks:
            return
        summary = _local_summary(c, ranks[0], self._started, time.time())
        statuses = {r.get("status") for r in ranks}
        if summary["status"] == "completed" and "aborted" in statuses:
            summary["status"] = "aborted"
        if self.lost is not None:
            summary["status"] = "failed"
            summary["abort_reason"] = summary.get("abort_reason") or self.lost
        summary["steps_completed"] = min(int(r["steps_completed"]) for r in ranks)
        summary["workers"] = self.world_size
        summary["launcher"] = self.launcher
        # Steps at which the ranks exchanged reports: a clean step makes none.
        summary["exchanges"] = self.exchanges
        summary["ranks"] = sorted(ranks, key=lambda r: int(r.get("rank", 0)))
        self.run_dir.write_summary(summary)


def reporter_for(ctx: WorkerContext, engine: Engine, run_dir: RunDir | None) -> GroupReporter:
    """The reporter of a launched rank (`ctx.launcher` set): rank 0 holds the group's controller,
    journaling into `run_dir`; the exchanges run on the default process group."""
    from remedy.control.decide import Controller  # noqa: PLC0415 - the Guard's local mode only

    controller = None
    if ctx.rank == 0:
        # No straggler watch: the other ranks' step times never reach rank 0.
        controller = Controller(
            engine, world_size=ctx.world_size, journal=run_dir is not None, straggler=None
        )
    return GroupReporter(
        controller,
        rank=ctx.rank,
        world_size=ctx.world_size,
        group=dist.group.WORLD,
        run_dir=run_dir,
        launcher=ctx.launcher or "a launcher",
    )


class Joining(Protocol):
    """What `join` reads of a launched rank: a Guard, or a framework loop's (`integrations`)."""

    @property
    def ctx(self) -> WorkerContext: ...
    @property
    def rank(self) -> int: ...
    @property
    def agreement(self) -> Agreement | None: ...


def join(guard: Joining) -> None:
    """A launched rank's Guard has its group: agree on news with the commands, bound the
    agreement by the collective timeout, end on a lost peer, and say at start (rank 0) what
    only a supervisor could do."""
    ctx = guard.ctx
    name = ctx.launcher or "a launcher"
    if guard.agreement is not None:
        guard.agreement.timeout = collective_timeout()
    if COLLECTIVE_TIMEOUT_ENV in os.environ:
        # Asked for a bound: every collective of the group (DDP's too) times out after it.
        set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
        if set_timeout is not None:
            set_timeout(collective_timeout(), dist.group.WORLD)
    if ctx.membership is None:
        ctx.membership = LaunchedGroup(name)
    if guard.rank == 0:
        print(launcher.start_line(ctx), file=sys.stderr, flush=True)
    log.info("group_decides", rank=guard.rank, world_size=ctx.world_size, launcher=name)
