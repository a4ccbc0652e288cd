"""The command inbox of one rank: commands from the supervisor's replies, each applied once.

One implementation for every loop: the `Guard` and the framework callbacks
(`remedy.integrations`) both keep their commands here. The inbox

- takes the commands that came with the replies, keeping the highest `seq`
  seen (ranks of a process group apply commands up to the lowest such seq
  any of them has, so all apply the same ones at the same boundary);
- applies due commands in order (seq, chain, index) through
  `actions.apply_command` on an `ActionTarget`; a failed step of a chain
  fails the rest of that chain without running it, unless the rule said
  `continue_on_failure`;
- keeps each outcome until it goes out with a report, and sends a done
  command's outcome again when the supervisor still asks for it
  `OUTCOME_RESEND_S` after it last went out (a restarted supervisor that
  never got it);
- refuses a command whose id it applied already for another action (a
  supervisor that gave out an id twice): outcome `failed`, saying so, never
  the old action's outcome passed off as the new one's;
- holds its bookkeeping as one plain record (`state` / `adopt`) for a
  checkpoint, a replacement rank or a resumed process.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import structlog

from remedy.protocol.commands import Command, Outcome
from remedy.rank.actions import inprocess as actions

if TYPE_CHECKING:
    from remedy.rank.actions.inprocess import ActionTarget

log = structlog.get_logger("remedy.inbox")

# A done command sent again this long after its outcome went out gets the outcome again.
OUTCOME_RESEND_S = 2.0
HISTORY_KEPT = 1000
# An agreement's collective runs beside a whole step: past this, a peer is gone.
AGREEMENT_TIMEOUT = datetime.timedelta(seconds=300)


class CommandInbox:
    """Queued, done and failed commands of one rank, and the outcomes still to send."""

    def __init__(self) -> None:
        self.queued: dict[str, Command] = {}
        self.done_ids: set[str] = set()
        self.actions: dict[str, str] = {}  # each done command's action, by decision id
        self._refused: set[str] = set()  # ids refused for naming another action than applied
        self.failed_chains: set[str] = set()
        self.max_seq = 0
        self.history: deque[Outcome] = deque(maxlen=HISTORY_KEPT)  # newest last
        self._unsent: list[Outcome] = []
        # Each done command's outcome and when it last went out.
        self._outcome_of: dict[str, tuple[Outcome, float]] = {}

    # ---------------------------------------------------------------- intake
    def take(self, raw: Iterable[dict[str, Any]], *, now: float | None = None) -> None:
        """Queue the commands of a reply; a done one still asked for gets its outcome again."""
        now = time.monotonic() if now is None else now
        for item in raw:
            cmd = Command.from_dict(item)
            self.max_seq = max(self.max_seq, cmd.seq)
            if cmd.decision_id not in self.done_ids or self._reused(cmd):
                # A reused id is queued too: it is refused where it would apply, at the
                # same boundary on every rank (`apply`).
                self.queued.setdefault(cmd.decision_id, cmd)
                continue
            # Done already: once the replies to reports sent before the outcome are
            # in, a command that still comes is one whose outcome was lost.
            done = self._outcome_of.get(cmd.decision_id)
            if done is not None and now - done[1] >= OUTCOME_RESEND_S:
                self._unsent.append(done[0])
                self._outcome_of[cmd.decision_id] = (done[0], now)

    def submit(self, command: Command) -> None:
        """Queue one command by hand (an operator's intervention, a test)."""
        if command.decision_id not in self.done_ids or self._reused(command):
            self.queued.setdefault(command.decision_id, command)

    def _reused(self, cmd: Command) -> bool:
        """`cmd`'s id was applied for another action, and not refused yet."""
        done = self.actions.get(cmd.decision_id)
        return done is not None and done != cmd.action and cmd.decision_id not in self._refused

    def latest_applied(self) -> list[str]:
        """The highest id applied of each supervisor incarnation (`control.identity`): what a
        supervisor that lost its journal must give ids above."""
        best: dict[str, tuple[int, str]] = {}
        for decision_id in list(self.done_ids):  # a copy: asked from a control thread
            head, _, seq = decision_id.rpartition("-d")
            number = int(seq) if seq.isdigit() else -1
            if number >= best.get(head, (-2, ""))[0]:
                best[head] = (number, decision_id)
        return sorted(d for _, d in best.values())

    # ------------------------------------------------------------ what is due
    def due_at_tick(self, tick: int) -> list[Command]:
        """Commands due at this boundary of a rank that applies them by tick (no group)."""
        return _ordered(c for c in self.queued.values() if c.apply_at_tick <= tick)

    def due_up_to_seq(self, seq: int) -> list[Command]:
        """Commands up to the seq every rank of the group has: the same set on every rank."""
        return _ordered(c for c in self.queued.values() if c.seq <= seq)

    def agreed_seq(self, group: Any, device: Any = None) -> int:
        """The lowest `max_seq` of every rank of `group`: a collective every rank makes here.

        Raises what the collective raises (a lost peer), for the caller to handle.
        """
        import torch  # noqa: PLC0415 - only ranks of a process group get here
        import torch.distributed as dist  # noqa: PLC0415

        agreed = torch.tensor([self.max_seq], dtype=torch.int64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
        return int(agreed.item())

    def all_queued(self) -> list[Command]:
        """Every queued command, in chain order (an OOM's answer, applied at once)."""
        return sorted(self.queued.values(), key=lambda c: (c.chain_id, c.chain_index))

    # ------------------------------------------------------------------ apply
    def apply(self, commands: list[Command], target: ActionTarget) -> list[Outcome]:
        """Apply `commands` in order on `target`; a failed step stops the rest of its chain."""
        out: list[Outcome] = []
        for cmd in commands:
            self.queued.pop(cmd.decision_id, None)
            if self._reused(cmd):
                self._refused.add(cmd.decision_id)
                outcome = Outcome(
                    cmd.decision_id, target.rank, "failed", target.step_count, target.tick,
                    f"refused: decision id {cmd.decision_id} was applied already, for "
                    f"{self.actions[cmd.decision_id]}, not {cmd.action}",
                )  # fmt: skip
                log.warning("command_refused", decision_id=cmd.decision_id,
                            action=cmd.action, applied=self.actions[cmd.decision_id])  # fmt: skip
                self._unsent.append(outcome)
                self._outcome_of[cmd.decision_id] = (outcome, time.monotonic())
                self.history.append(outcome)
                out.append(outcome)
                continue
            self.done_ids.add(cmd.decision_id)
            self.actions[cmd.decision_id] = cmd.action
            if cmd.chain_id and cmd.chain_id in self.failed_chains:
                outcome = Outcome(
                    cmd.decision_id, target.rank, "failed", target.step_count, target.tick,
                    "not run: an earlier step of its chain failed",
                )  # fmt: skip
            else:
                outcome = actions.apply_command(target, cmd)
                outcome.result.setdefault("late_by_ticks", target.tick - cmd.apply_at_tick)
                if outcome.outcome != "applied" and cmd.chain_id and not cmd.continue_on_failure:
                    self.failed_chains.add(cmd.chain_id)
            self._unsent.append(outcome)
            self._outcome_of[cmd.decision_id] = (outcome, time.monotonic())
            self.history.append(outcome)
            out.append(outcome)
            log.info(
                "action",
                action=cmd.action,
                outcome=outcome.outcome,
                detail=outcome.detail,
                rank=target.rank,
            )
        return out

    # ---------------------------------------------------------------- outbox
    @property
    def has_unsent(self) -> bool:
        return bool(self._unsent)

    def drain_outcomes(self) -> list[dict[str, Any]]:
        """The outcomes not yet reported, as wire records; they count as sent now."""
        out, self._unsent = self._unsent, []
        return [o.to_dict() for o in out]

    # ------------------------------------------------------------ bookkeeping
    def state(self, *, with_queued: bool = True) -> dict[str, Any]:
        """The bookkeeping as a plain record (what a checkpoint or a replacement rank takes)."""
        record: dict[str, Any] = {
            "done_ids": sorted(self.done_ids),
            "max_seq": self.max_seq,
            "failed_chains": sorted(self.failed_chains),
            "actions": dict(self.actions),
            "refused": sorted(self._refused),
        }
        if with_queued:
            record["queued"] = [c.to_dict() for c in self.queued.values()]
        return record

    def adopt(self, record: dict[str, Any]) -> None:
        """Continue from `record` (see `state`): no command is applied twice."""
        self.done_ids = set(record["done_ids"])
        self.max_seq = int(record["max_seq"])
        self.failed_chains = set(record["failed_chains"])
        self.actions = {str(k): str(v) for k, v in record.get("actions", {}).items()}
        self._refused = set(record.get("refused", []))
        self.queued = {c["decision_id"]: Command.from_dict(c) for c in record.get("queued", [])}


class Agreement:
    """Which commands every rank of a group applies, agreed at no host sync of its own.

    Once per step every rank launches one all-reduce (MIN) of a small int64
    tensor and does not wait for it (`launch`, as its step begins): the highest
    command seq it holds, whether it has news for the group's decider, and the
    step's phase numbers (`rank.loop.phases`: how late it came to the step, in
    ms, and whether it warms up), the last two negated so that their MIN is the
    group's MAX. The Guard reads the result in the one host sync its step makes
    anyway (`for_sync`, stacked with the loss and the gradient norm, then
    `settle`), and the commands up to that seq apply at the next boundary
    (`agreed`): every rank held them when it launched, so every rank applies
    the same ones at the same boundary, one step after they all had them. A
    step that ended early (a lost peer, an OOM) reads nothing; the next
    boundary then waits for the result itself. The first boundary of a group
    (the loop's, or one after a regroup) has nothing launched yet: it agrees
    there and then, so commands queued before the loop (or adopted with a
    replacement's state) apply at once.

    The news (`group_decide`: a group that decides without a supervisor) is
    whether any rank had something for the group's decider when it launched,
    read at the next boundary, so a clean step pays nothing more than the one
    all-reduce.
    """

    # The launched tensor's entries (`launch`).
    SEQ, NEWS, LATE_MS, WARMING = range(4)

    def __init__(self, group: Any, device: Any) -> None:
        self.group = group
        self.device = device
        self._tensor: Any = None
        self._work: Any = None
        self._agreed: int | None = None
        # The flag channel (`launch_flag`): whether any rank flagged the step just run.
        self._flag_tensor: Any = None
        self._flag_work: Any = None
        self._news: bool | None = None  # read with the agreed seq, not yet handed out
        self.news = False  # whether any rank had news at the agreement `agreed` returned
        # The group's (latest arrival in ms, any rank warming 0/1) of the step that read
        # the agreement last (`settle`); None when no step has read one since.
        self.phase: list[float] | None = None
        # How long a launched agreement may take before a peer counts as lost.
        self.timeout = AGREEMENT_TIMEOUT

    def launch(
        self, max_seq: int, *, news: bool = False, late_ms: int = 0, warming: bool = False
    ) -> None:
        """Start the agreement on what this rank holds (every rank, at the same point of the
        same step). `news`: this rank has something for the group's decider; `late_ms`,
        `warming`: this rank's phase numbers for the step beginning (`rank.loop.phases`)."""
        import torch  # noqa: PLC0415 - only ranks of a process group get here
        import torch.distributed as dist  # noqa: PLC0415

        # MIN of -x is -(MAX of x): -1 for news when any rank has news.
        values = [max_seq, -int(news), -int(late_ms), -int(warming)]
        self._tensor = torch.tensor(values, dtype=torch.int64, device=self.device)
        self._work = dist.all_reduce(
            self._tensor, op=dist.ReduceOp.MIN, group=self.group, async_op=True
        )

    def for_sync(self) -> Any:
        """The launched agreement's tensor, for the step's host sync to read (None if none).

        Waits for the collective on the device (a stream wait under NCCL; on
        gloo it is long done, every rank having launched it before the step's
        own collectives). Raises what the collective raised (a lost peer).
        """
        if self._work is None:
            return None
        self._work.wait(timeout=self.timeout)
        self._work = None
        tensor, self._tensor = self._tensor, None
        return tensor

    def settle(self, values: list[float]) -> None:
        """The agreement's numbers, as the step's sync read them (`for_sync`'s tensor)."""
        self._agreed = int(values[self.SEQ])
        self._news = values[self.NEWS] < 0
        self.phase = [-values[self.LATE_MS], -values[self.WARMING]]

    def agreed(self, max_seq: int) -> int | None:
        """The seq agreed at the previous boundary; at the first boundary of a group (nothing
        launched yet) the one agreed now, on `max_seq`, at a host sync of its own."""
        if self._work is None and self._agreed is None:
            self.launch(max_seq)
        pending = self.for_sync()
        if pending is not None:  # no step read it: read it here (a sync of its own)
            self.settle(pending.tolist())
        agreed, self._agreed = self._agreed, None
        self.news, self._news = bool(self._news), None
        return agreed

    def launch_flag(self, tick: int | None) -> None:
        """Start telling the group whether this rank flagged the step just run (at `tick`).

        Every rank launches it once per step, after its detectors' flags and
        before the optimizer step, which it overlaps; `flagged` reads it at the
        next boundary. With a policy that replays, the ranks hold at that
        boundary for the supervisor's decision on the flagged step
        (`workers.flag_hold`). A MIN all-reduce of -(tick + 1) is the highest
        flagged tick, negated.
        """
        import torch  # noqa: PLC0415 - only ranks of a process group get here
        import torch.distributed as dist  # noqa: PLC0415

        value = -(tick + 1) if tick is not None else 0
        self._flag_tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        self._flag_work = dist.all_reduce(
            self._flag_tensor, op=dist.ReduceOp.MIN, group=self.group, async_op=True
        )

    @property
    def flag_launched(self) -> bool:
        return self._flag_work is not None

    def flagged(self) -> int | None:
        """The highest tick any rank flagged in the step just run, or None (nothing launched,
        or nobody flagged). Waits for the collective (a host sync under NCCL); raises what
        it raised (a lost peer)."""
        if self._flag_work is None:
            return None
        work, self._flag_work = self._flag_work, None
        work.wait(timeout=self.timeout)
        value = int(self._flag_tensor.item())
        self._flag_tensor = None
        return -value - 1 if value < 0 else None

    def finish(self) -> None:
        """A launched agreement nobody will read (the loop ended): let it complete."""
        with contextlib.suppress(RuntimeError):  # a peer lost at the very end
            self.for_sync()
            self.flagged()


def _ordered(commands: Iterable[Command]) -> list[Command]:
    return sorted(commands, key=lambda c: (c.seq, c.chain_id, c.chain_index))
