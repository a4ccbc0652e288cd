"""The rank side of the supervisor link: send reports, collect commands, never block.

Each report is an actor call whose reply carries the commands this rank
still owes. Replies are collected with a zero-timeout `ray.wait` at the
next step boundary, so the training loop never waits on the supervisor.

The supervisor may be away: killed and restarted by Ray (it is a detached
actor with unbounded restarts), which takes seconds. Its handle stays good
across the restart and Ray retries the calls that were in flight, so the
reports reach the new instance, which deduplicates them by (rank,
incarnation, seq). Meanwhile the rank keeps training: past
`MAX_IN_FLIGHT` unanswered reports, new batches are held back and merged
into one (events and outcomes all kept, metrics bounded with the oldest
dropped first) that goes out as soon as the replies come again. A reply is
the supervisor's acknowledgement: it journals what a batch carried before
it answers. A report that fails outright (the supervisor gone for good, or
a reply lost) puts its events and outcomes back into the held batch, to be
sent again. Each batch says the lowest number still unanswered
(`unanswered_from`): a number below it that the supervisor lacks will never
come (a node agent answered it and died before sending it on, or it failed and
went out again under a new number), so the supervisor stops awaiting it.

A supervisor that is alive but answers nothing is not restarted by Ray: the
reporter's `SilenceWatch` (`supervisor.liveness`) counts a report unanswered
for its bound as a hung supervisor, kills its process so that Ray restarts
it, and attaches a note of the outage to the next report once answers come
back. Every step and `close` look; none of it blocks the training loop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import TYPE_CHECKING, Any

import ray
import structlog

from remedy.rank.chaos import process_faults
from remedy.rank.link import liveness

if TYPE_CHECKING:
    from collections.abc import Callable

log = structlog.get_logger("remedy.reporter")

# Unanswered reports in flight before new batches are held back and merged.
MAX_IN_FLIGHT = 16
# Metrics records held while the supervisor is away; past this the oldest are dropped.
MAX_HELD_METRICS = 5000
# How long the last reports of a rank wait for a supervisor (a restart takes seconds).
CLOSE_TIMEOUT_S = 120.0
# A `send(wait=True)` (the OOM path) waits at most this long.
WAIT_TIMEOUT_S = 30.0
# The Guard's default heartbeat, until the Guard says its own (`set_heartbeat`).
HEARTBEAT_S = 0.5
# A rank reporting to the supervisor while its run has node agents looks for its node's
# agent this often (a node that joined the run gets one within the supervisor's
# `NEW_NODES_S`), and after `AGENT_LOOKS` misses this much less often.
AGENT_LOOK_S = 2.0
AGENT_LOOKS = 30
AGENT_LOOK_LATE_S = 30.0


class RayReporter:
    """Sends this rank's batches stamped with (rank, incarnation, seq) and the run's token.

    The supervisor refuses batches of an incarnation it has replaced, so
    messages still in flight from a killed process count for nothing.
    """

    def __init__(
        self,
        supervisor: Any,
        *,
        rank: int = 0,
        incarnation: int = 1,
        token: str = "",
        silence_s: float | None = None,
        control: Any = None,
        to_agent: bool = False,
        find_agent: Callable[[], Any | None] | None = None,
    ) -> None:
        self.supervisor = supervisor
        # Who the chaos faults that act on the run ask or kill (`kill_supervisor`, `kill_node`):
        # the supervisor itself, also when the reports go to this node's agent.
        self.control = supervisor if control is None else control
        self.token = token  # the run's token: a batch without it is refused
        self.rank = rank
        self.incarnation = incarnation
        self.seq = 0
        # Each report in flight, with the batch it carries and when it went out.
        self._in_flight: list[tuple[ray.ObjectRef, dict[str, Any], float]] = []
        self._held: dict[str, Any] | None = None
        self._inbox: list[dict[str, Any]] = []
        # The newest tick the supervisor said it has decided on (a reply to a report that
        # was `holding` for it: workers.flag_hold): in the replies taken, and in those `poll`
        # has handed out, which `settled` says (a tick reads settled with its commands).
        self._settled_taken = -1
        self._settled = -1
        self.lost_replies = 0
        self.dropped_metrics = 0  # metrics records dropped while the supervisor was away
        # Who the supervisor is (node, pid, start time), asked now and after each outage: a
        # hung one answers nothing, so its pid must be known before it is needed.
        self._silence_s = silence_s
        # `to_agent`: `supervisor` is this node's agent; its silences are noted as the agent's.
        self.watch = liveness.SilenceWatch(
            f"rank {rank}",
            liveness.silence_bound(HEARTBEAT_S, silence_s),
            silent="agent" if to_agent else "supervisor",
        )
        self._ident: liveness.Identity | None = None
        # When the oldest report not yet answered went out (a failed one stays unanswered).
        self._unanswered_since: float | None = None
        # When replies were last looked for: a reply found now came after it.
        self._looked_at: float | None = None
        self._header: dict[str, Any] = {}  # rank, step and tick of the newest report
        self._ident_ref: ray.ObjectRef | None = self._ask_where()
        # Where the run has node agents but this node's had not answered when the rank
        # started (a node that joined during the run): look for it now and then, and
        # report through it once it is there.
        self._find_agent = None if to_agent else find_agent
        self._agent_looks = 0
        self._next_look = time.monotonic() + AGENT_LOOK_S

    def set_heartbeat(self, heartbeat_s: float) -> None:
        """The Guard's heartbeat: the silence bound is derived from it (unless one was given)."""
        self.watch.bound_s = liveness.silence_bound(heartbeat_s, self._silence_s)

    def send(self, batch: dict[str, Any], *, wait: bool = False) -> None:
        self._collect(timeout=0)
        self._watch()
        self._look_for_agent()
        if self._held is not None or len(self._in_flight) >= MAX_IN_FLIGHT:
            self._hold(batch)
            self._release()
        else:
            self._post(batch)
        if wait:
            self._drain(WAIT_TIMEOUT_S)

    def poll(self) -> list[dict[str, Any]]:
        self._collect(timeout=0)
        self._watch()
        self._release()
        out, self._inbox = self._inbox, []
        self._settled = self._settled_taken
        return out

    def settled(self) -> int:
        """The newest tick the supervisor has said it decided on (-1: none yet), in the replies
        `poll` has handed out: the commands decided on it are out of `poll` by then.

        It takes no reply itself: a rank holding for a tick (workers.flag_hold) that saw it
        settled by a reply taken after its poll would leave the hold without those commands.
        """
        return self._settled

    def close(self) -> None:
        self._drain(CLOSE_TIMEOUT_S)

    def kill_supervisor(self) -> None:
        """Chaos: SIGKILL the supervisor's process (Ray restarts it); by Ray if on another node."""
        node, pid = ray.get(self.control.where.remote(), timeout=30)[:2]
        if node == ray.util.get_node_ip_address():
            os.kill(pid, signal.SIGKILL)
        else:
            ray.kill(self.control, no_restart=False)

    def kill_node(self) -> str:
        """Chaos: SIGKILL this rank's Ray node, raylet and all; returns only to say why not.

        The supervisor is asked first and journals the kill (or the refusal) before
        it happens: it refuses the node it runs on itself, and the cluster's head.
        """
        node = ray.get_runtime_context().get_node_id()
        answer = ray.get(
            self.control.chaos_kill_node.remote(self.token, self.rank, node), timeout=30
        )
        if not answer.get("kill"):
            return str(answer.get("reason"))
        try:
            process_faults.kill_node()
        except ProcessLookupError as exc:
            return str(exc)
        return "the node was killed, yet this process lives on"  # not reached: SIGKILL

    @property
    def to_agent(self) -> bool:
        """Whether the reports go to this node's agent."""
        return self.watch.silent == "agent"

    def _look_for_agent(self) -> None:
        """Report through this node's agent from now on, once it answers to its name.

        Reports already out stay with the supervisor and are collected as before;
        the next batch goes to the agent, which takes the rank as it takes any rank's
        first report there (the batch numbers the supervisor has answered lie below
        the batch's `unanswered_from`, so the agent never awaits them).
        """
        if self._find_agent is None or time.monotonic() < self._next_look:
            return
        if self.watch.outage is not None:  # a silence of the supervisor's is its own to end
            return
        self._agent_looks += 1
        late = self._agent_looks >= AGENT_LOOKS
        self._next_look = time.monotonic() + (AGENT_LOOK_LATE_S if late else AGENT_LOOK_S)
        try:
            agent = self._find_agent()
        except ray.exceptions.RayError as exc:  # the GCS away: look again later
            log.info("agent_lookup_failed", error=str(exc)[:200])
            return
        if agent is None:
            return
        self._find_agent = None
        self.supervisor = agent
        self.watch.silent = "agent"
        self._ident, self._ident_ref = None, self._ask_where()
        log.info("reports_to_agent", rank=self.rank, looks=self._agent_looks)

    @property
    def supervisor_lost(self) -> str | None:
        """Why the supervisor is lost for good (not restarted after its kill), else None."""
        return self.watch.gave_up

    def _ask_where(self) -> ray.ObjectRef | None:
        """Ask the supervisor which process it is (None if it cannot say: a stand-in in tests)."""
        where = getattr(self.supervisor, "where", None)
        return where.remote() if where is not None else None

    def _watch(self) -> None:
        """Look whether the supervisor answers; kill a hung one (see `supervisor.liveness`)."""
        if self._ident_ref is not None:
            ready, _ = ray.wait([self._ident_ref], timeout=0)
            if ready:
                with contextlib.suppress(ray.exceptions.RayError):
                    self._ident = liveness.Identity.from_wire(ray.get(self._ident_ref))  # ready
                self._ident_ref = None
        action = self.watch.check(self._unanswered_since)
        if action == "kill":
            self.watch.killed(
                liveness.kill(
                    self._ident,
                    self.supervisor,
                    here=ray.util.get_node_ip_address(),
                    may_ray_kill=self.rank == 0,
                )
            )

    @property
    def unanswered_from(self) -> int:
        """The lowest batch number not answered yet (the next one, when all were)."""
        return min([b["seq"] for _, b, _ in self._in_flight] + [self.seq + 1])

    # ------------------------------------------------------------------
    def _post(self, batch: dict[str, Any]) -> None:
        self.seq += 1
        batch["incarnation"] = self.incarnation
        batch["seq"] = self.seq
        # Every number below this one was answered, or failed and its contents went into a
        # later batch: one the receiver still lacks will never come (a node agent answered it
        # and died before sending it on), and the receiver stops awaiting it.
        batch["unanswered_from"] = min([b["seq"] for _, b, _ in self._in_flight] + [self.seq])
        batch["token"] = self.token
        notes = self.watch.take_notes()
        if notes:  # outages this rank saw end: the supervisor journals them
            batch["outages"] = [*batch.get("outages", []), *notes]
        self._header = {k: batch[k] for k in ("rank", "step", "tick") if k in batch}
        now = time.time()
        if self._unanswered_since is None:
            self._unanswered_since = now
        self._in_flight.append((self.supervisor.report.remote(batch), batch, now))

    def _hold(self, batch: dict[str, Any], *, newer: bool = True) -> None:
        """Merge `batch` into the held one: the newest header, every event and outcome.

        `newer=False`: `batch` is older than what is held (a failed report sent
        again), so the held header (step, tick) stays.
        """
        held = self._held
        if held is None:
            self._held = held = {**batch, "events": [], "metrics": [], "outcomes": []}
        elif newer:
            body = ("events", "metrics", "outcomes")
            held.update({k: v for k, v in batch.items() if k not in body})
        held["events"].extend(batch.get("events") or [])
        held["outcomes"].extend(batch.get("outcomes") or [])
        if batch.get("outages"):
            held.setdefault("outages", []).extend(batch["outages"])
        metrics = held["metrics"]
        metrics.extend(batch.get("metrics") or [])
        if len(metrics) > MAX_HELD_METRICS:
            drop = len(metrics) - MAX_HELD_METRICS
            del metrics[:drop]
            self.dropped_metrics += drop

    def _release(self) -> None:
        """Send the held batch once the supervisor answers again."""
        if self._held is not None and len(self._in_flight) < MAX_IN_FLIGHT:
            held, self._held = self._held, None
            if self.dropped_metrics:
                log.warning("report_metrics_dropped", count=self.dropped_metrics)
            self._post(held)

    def _collect(self, *, timeout: float | None) -> None:
        if not self._in_flight:
            return
        refs = [ref for ref, _, _ in self._in_flight]
        previous = self._looked_at or 0.0  # never looked: whatever came, came unseen
        ready, _ = ray.wait(refs, num_returns=len(refs) if timeout == 0 else 1, timeout=timeout)
        self._looked_at = time.time()
        if not ready:
            return
        done = set(ready)
        kept = []
        answered: float | None = None  # when the oldest report answered now went out
        for ref, batch, sent in self._in_flight:
            if ref not in done:
                kept.append((ref, batch, sent))
                continue
            try:
                self._take_reply(ray.get(ref))  # ready: ray.wait returned it
                answered = sent if answered is None else min(answered, sent)
            except ray.exceptions.RayError as exc:
                # Unacknowledged: its events and outcomes go out again with the next batch.
                self.lost_replies += 1
                log.warning("report_failed", error=str(exc)[:300])
                self._hold({**batch, "metrics": []}, newer=False)
        self._in_flight = kept
        if answered is not None:
            if self.watch.outage is not None:
                self._ident_ref = self._ask_where()  # restarted: a new process
            # The replies came after the previous look. A rank that looks only at its step
            # boundaries, or not at all while it re-forms its group after a peer's loss, did
            # not see the supervisor silent in between: the silence it saw ends at its
            # previous look, not when it looked again.
            oldest = min(answered, self._unanswered_since or answered)
            self.watch.answered(oldest, at=max(oldest, previous))
            # It answers: reports still out count their silence from now, not from before.
            self._unanswered_since = time.time() if kept else None

    def _take_reply(self, reply: Any) -> None:
        """A reply: the commands this rank owes, and to a `holding` report, a dict with them
        and the tick it settles (None while the supervisor still waits on other ranks)."""
        if isinstance(reply, dict):
            settled = reply.get("settled")
            if isinstance(settled, int):
                self._settled_taken = max(self._settled_taken, settled)
            reply = reply.get("commands") or []
        self._inbox.extend(reply)

    def _drain(self, timeout_s: float) -> None:
        """Wait until every report is answered (held ones sent), at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self._in_flight or self._held is not None or (self.watch.notes and self._header):
            if self.watch.notes and not self._in_flight and self._held is None:
                # The last reports are answered, and an outage ended meanwhile: say so
                # before this rank's end (its notes ride on a report of their own).
                self._post({**self._header, "events": [], "metrics": [], "outcomes": []})
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning(
                    "reports_unanswered",
                    in_flight=len(self._in_flight),
                    held=self._held is not None,
                )
                return
            self._release()
            self._collect(timeout=min(left, 1.0))
            self._watch()
            if self.watch.gave_up is not None:
                return
