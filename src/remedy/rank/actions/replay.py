"""`replay_step`: was the anomaly the data, or a chip? Re-run the step and compare.

A NaN or a loss spike has two kinds of cause with opposite cures: the data or
the optimisation (roll back, skip the batches, cut the LR), or a chip that
computed a wrong result (replace that rank; rolling back and skipping healthy
data is the wrong cure, and the fault comes back). A replay tells them apart
within the step boundary where it is applied, on every rank at once:

1. *Back to the step.* Every rank returns to the state from just before the
   anomalous step S: the weights, optimizer, scheduler and scaler state a rank
   that saw the anomaly kept before its update (see below), broadcast to the
   ranks that saw nothing (data-parallel replicas hold the same state), and
   each rank's own RNGs and data position at that boundary (`StepMark`).
2. *The same step again.* Every rank re-runs its batch of S with the same RNG
   state, with the gradient all-reduce, exactly as S ran: its loss, and the
   gradients' digest after the reduce (`workers.digests`: exact bit sums, and
   float64 sums for a tolerance), are compared with what the original step
   gave (kept with the pre-step state).
3. *Another chip on the same input*, when the re-run shows nothing (the same
   numbers again on every rank, replicas agreeing): the suspected rank re-runs
   its batch alone (no all-reduce: its own local gradients) and a peer, the
   *witness*, runs the same batch from the same state with the same RNG state
   (the batch and RNG state are sent to it; a poisoned batch carries its
   poison along, as bad data would). A data-parallel peer holds bitwise-equal
   parameters, so on a healthy pair both give the same bits; a chip that
   corrupts its forward on every run does not. The issue behind this module
   asks for a warm spare here; a spare actor has no model until it becomes a
   rank (its model is built by the user's function), so the peer stands in.
4. *The answer* (`classify`), the same on every rank (each has the whole
   table after one all-gather per phase):
   - `replay_rank_specific`: the witness does not reproduce the suspected
     rank's result, or the replicas' re-runs disagree (one rank's reduced
     gradient differs from its peers'): that rank's chip is at fault;
   - `replay_transient`: the re-run differs from the original (loss or
     gradients) and every check agrees now: a transient fault on the rank
     whose result moved;
   - `replay_reproducible`: the same numbers everywhere: data or numerics.
5. Every rank is left at the boundary before S, and holds there until the
   policy's answer to the classification is in (`Hold`; the supervisor sends
   it as a `<decision>-answer` command after the classification's decisions):
   a rollback is applied, or the restart of the faulty rank re-forms the group
   (the survivors' waiting collective fails when it is killed), or the answer
   says nothing follows. Training does not move on before that.

What it keeps, and what that costs: at every step boundary, the RNG states and
the data position (one `capture_rng`, the same one a multi-rank job's
membership takes anyway); for data that cannot be read again (a plain
iterable), the batch itself and the RNG state after fetching it. The full
state (weights, optimizer...) is copied only on a step that a detector will
report (`DetectorSuite.flags`, asked between backward and the optimizer step):
its pre-update state and the original's loss and gradient digest. The last
`PRE_STEPS_KEPT` such steps are kept (a persistently bad rank flags every step).

What it does not cover: sharded models (FSDP2/HSDP: no peer holds a rank's
shard to replay it from), framework callbacks (the framework runs the step),
and a gradient corrupted on one rank *before* the all-reduce with no trace in
its loss (every replica then holds the same wrong sum; the re-run shows a
transient fault, and the rank named is the one that raised the anomaly).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog
import torch
import torch.distributed as dist

from remedy.rank.exceptions import ActionError
from remedy.rank.group.replicas import unwrap_ddp
from remedy.rank.link.flag_hold import agree_while_holding
from remedy.rank.state.digests import Digest, digest, fold, odd_ones, same_number
from remedy.rank.state.snapshots import Snapshot, capture_rng, restore_rng

if TYPE_CHECKING:
    from remedy.protocol.commands import Command
    from remedy.rank.guard import Guard

log = structlog.get_logger("remedy.replay")

# Pre-step states (full copies) kept at once: the anomalous step and the next.
PRE_STEPS_KEPT = 2
# Step marks kept at most, whatever `Replays.window_s` says (steps of a few ms).
MAX_MARKS = 1024
# Ranks listed in a classification's evidence (it goes into an anomaly's details,
# which are bounded): the suspect, the witness, the odd ones, then the lowest.
EVIDENCE_RANKS = 8


@dataclass
class StepMark:
    """A step's boundary: what the step started from, besides the (shared) training state.

    `batch` and `forward_rng` are kept only for data that cannot be read again.
    """

    step: int
    tick: int
    cursor: int
    rng: dict[str, Any]
    at: float = 0.0  # when (monotonic)
    batch_index: int = -1
    batch: Any = None
    forward_rng: dict[str, Any] | None = None


@dataclass
class PreStep:
    """The state from just before a step a detector flagged, taken before its update."""

    snapshot: Snapshot  # at the step's boundary (its mark's RNGs and data position)
    loss: float  # the original step's loss on this rank
    grads: Digest  # its gradients after the all-reduce (and unscaling, clipping)
    flagged: str  # "loss" or "grads": what made it suspect


@dataclass
class Hold:
    """A replay waits for the policy's answer (see the module docstring, point 5)."""

    decision_id: str
    since: float
    answer: dict[str, Any] | None = None

    @property
    def restart(self) -> list[int]:
        """Ranks the answer restarts (the survivors wait for the group to re-form)."""
        return list((self.answer or {}).get("restart", []))


@dataclass
class Replays:
    """One rank's side of `replay_step`: step marks, pre-step states, the hold.

    Marks are kept for the last `window` steps and, beyond that, for the last
    `window_s` seconds (at most `MAX_MARKS`): when the ranks do not hold for
    the decision (`workers.flag_hold`), a replay command comes after the
    anomaly's report has reached the supervisor and come back, which on fast
    steps is many steps later.
    """

    window: int  # step marks kept at least (0: replays are off)
    window_s: float = 0.0  # and marks this recent
    marks: deque[StepMark] = field(init=False)
    kept: deque[PreStep] = field(init=False)
    hold: Hold | None = None

    def __post_init__(self) -> None:
        self.marks = deque()
        self.kept = deque(maxlen=PRE_STEPS_KEPT)

    # ------------------------------------------------------------- each step
    def mark(self, guard: Guard) -> StepMark:
        """Record the boundary the next step starts from (before its batch is fetched)."""
        rng = capture_rng()
        if self.marks:  # an RNG the loop did not draw from since shares its copy
            rng = _shared(rng, self.marks[-1].rng)
        now = time.monotonic()
        mark = StepMark(guard.step_count, guard.tick, guard.cursor.position, rng, now)
        if self.window:
            marks = self.marks
            marks.append(mark)
            while len(marks) > MAX_MARKS or (
                len(marks) > self.window and now - marks[0].at > self.window_s
            ):
                marks.popleft()
        return mark

    def fetched(self, mark: StepMark, index: int, batch: Any, *, rewindable: bool) -> None:
        """The step's batch: kept only if it cannot be read again (a survivor that loses the
        step to a failed collective trains it again, `rank.group.regroup`), and with the RNG
        state after fetching it where steps may be replayed."""
        mark.batch_index = index
        if not rewindable:
            mark.batch = batch
            if self.window:
                mark.forward_rng = capture_rng()

    def keep(self, guard: Guard, loss: float, *, flagged: str) -> None:
        """Keep the state from before the current step's update (a detector flagged it)."""
        mark = self.mark_of(guard.step_count)
        if not self.window or mark is None or mark.tick != guard.tick:
            return
        recycled = self.kept[0].snapshot if len(self.kept) == self.kept.maxlen else None
        taken = guard.take_snapshot(into=recycled)
        snap = dataclasses.replace(taken, cursor=mark.cursor, rng=mark.rng)
        self.kept.append(PreStep(snap, loss, digest(_grads(guard)[0]), flagged))

    def forget_after(self, step: int) -> None:
        """The loop went back to the boundary before `step`: later marks are of an abandoned
        timeline."""
        while self.marks and self.marks[-1].step > step:
            self.marks.pop()
        self.kept = deque((k for k in self.kept if k.snapshot.step <= step), PRE_STEPS_KEPT)

    def mark_of(self, step: int) -> StepMark | None:
        return next((m for m in reversed(self.marks) if m.step == step), None)

    def kept_at(self, step: int) -> PreStep | None:
        return next((k for k in reversed(self.kept) if k.snapshot.step == step), None)

    # ----------------------------------------------------------------- hold
    def answered(self, answer: dict[str, Any]) -> str:
        """The policy's answer to the replay came (`<decision>-answer`): end the hold, or wait
        for the restart it names."""
        hold = self.hold
        what = answer.get("actions") or []
        said = ", ".join(f"{a.get('action')} ({a.get('rule')})" for a in what) or "no action"
        if hold is None:
            return f"answer to a replay this rank is not waiting for: {said}"
        hold.answer = answer
        if hold.restart:
            ranks = ", ".join(map(str, hold.restart))
            return f"answer: {said}; waiting for rank(s) {ranks} to be replaced"
        self.hold = None
        return f"answer: {said}; training goes on"

    def agree(self, group: Any, device: torch.device, seq: int, late: bool) -> tuple[int, bool]:
        """One collective of the hold: the command seq every rank holds, and whether any rank
        has waited too long."""
        agreed, any_late, _ = agree_while_holding(group, device, seq, late=late)
        return agreed, any_late


def _shared(rng: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """`rng` with each generator's state that equals its state in `before` replaced by that
    copy, so the marks of a loop that draws from few generators cost little memory."""
    out = dict(rng)
    for key, state in rng.items():
        old = before.get(key)
        if old is not None and _same_state(state, old):
            out[key] = old
    return out


def _same_state(a: Any, b: Any) -> bool:
    """Whether two captures of one generator's state are equal (cheaply: C-level compares)."""
    if a is b:  # numpy's capture of a generator that did not move is the same object (`rng`)
        return True
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, list):  # CUDA: one state tensor per device
        return isinstance(b, list) and len(a) == len(b) and all(map(_same_state, a, b))
    if isinstance(a, tuple) and a and a[0] == "MT19937":  # numpy: (name, keys, pos, gauss...)
        return (
            isinstance(b, tuple)
            and len(a) == len(b)
            and a[2:] == b[2:]
            and bool(np.array_equal(a[1], b[1]))
        )
    return bool(a == b)  # Python's: a tuple of ints


def _grads(guard: Guard) -> tuple[list[torch.Tensor], list[str]]:
    """The gradients present, and their parameters' names, in parameter order."""
    tensors, names = [], []
    for name, p in unwrap_ddp(guard.model).named_parameters():
        if p.requires_grad and p.grad is not None:
            tensors.append(p.grad)
            names.append(name)
    return tensors, names


# ---------------------------------------------------------------- the replay
@dataclass
class _Run:
    """One re-run's numbers on one rank."""

    loss: float
    grads: Digest

    def same(self, other: _Run, tolerance: float) -> bool:
        return same_number(self.loss, other.loss, tolerance) and self.grads.same(
            other.grads, tolerance
        )


def replay_step(guard: Guard, params: dict[str, Any], command: Command) -> dict[str, Any]:
    """Carry out `replay_step` on this rank (every rank does, at the same boundary)."""
    replays: Replays = guard.replays
    if not replays.window:
        raise ActionError(
            "replay_step needs the step boundaries the Guard remembers, and this one keeps none "
            "(a single rank under a supervisor keeps them only with GuardConfig(replay_window=8))"
        )
    if guard.sharded:
        raise ActionError(
            "replay_step needs replicated parameters (DDP or one rank): a sharded model's "
            "ranks hold different shards, so no peer can re-run a rank's step"
        )
    tolerance = float(params.get("tolerance", 0.0))
    t0 = time.perf_counter()
    group = guard.group
    me, world = (dist.get_rank(group), dist.get_world_size(group)) if group else (0, 1)
    # 1. Which step, and which ranks kept its state.
    table0 = _gather(group, _holdings(replays))
    step = _choose_step(command.anomaly_step, table0)
    if step is None:
        kept = sorted({s for row in table0 for s in row["kept"]})
        raise ActionError(
            f"no rank kept the state from before step {command.anomaly_step} (pre-step states "
            f"kept: {kept or 'none'}; only a step a detector flags keeps one, and every rank must "
            f"still remember its start: the last {replays.window} steps and "
            f"{replays.window_s:g} s are)"
        )
    holders = [r for r, row in enumerate(table0) if step in row["kept"]]
    mark = replays.mark_of(step)
    assert mark is not None  # _choose_step checked every rank has it
    own = replays.kept_at(step)
    unread = _unread(replays, step) if not guard.cursor.rewindable else []
    # 2. Every rank to the state before `step`, from the lowest rank that kept it.
    source = holders[0]
    heavy = own.snapshot if own is not None else None
    if len(holders) < world:
        heavy = _broadcast(group, heavy if me == source else None, source)
    assert heavy is not None
    _to_boundary(guard, heavy, mark)
    t_restored = time.perf_counter()
    # 3. The step again, as it ran (with the gradient all-reduce), on every rank.
    batch, index, forward_rng, again = _same_step(guard, mark)
    t_again = time.perf_counter()
    row = {
        "kept": own is not None,
        "flagged": own.flagged if own is not None else None,
        "orig": _pack(_Run(own.loss, own.grads)) if own is not None else None,
        "replay": _pack(again) if again is not None else None,
        "names": _grads(guard)[1],
    }
    table1 = _gather(group, {**row, "error": None if again is not None else "re-run failed"})
    _fail_if_any(guard, heavy, mark, table1, "the re-run")
    suspect = _suspect(table1)
    # The re-run alone may show the fault already (numbers that moved, replicas that
    # disagree); only an answer of "the same numbers" needs another chip's opinion.
    alone = [{**row, "checked": None} for row in table1]
    verdict = classify(step=step, table=alone, suspect=suspect, witness=None,
                       tolerance=tolerance, source=source)  # fmt: skip
    witness = _witness(suspect, world) if verdict["kind"] == "replay_reproducible" else None
    # 4. The suspect's batch on the suspect and on the witness, each alone.
    if witness is not None:
        payload = None
        if me == suspect:
            factor = guard.injector.data_factor(index)
            payload = (_to_cpu(batch), index, forward_rng, factor)
        sent = _broadcast(group, payload, suspect)
        checked = _alone(guard, heavy, mark, sent) if me in (suspect, witness) else None
        failed = me in (suspect, witness) and checked is None
        table2 = _gather(
            group,
            {"checked": _pack(checked) if checked is not None else None, "error": failed or None},
        )
        _fail_if_any(guard, heavy, mark, table2, "the check on another rank")
        verdict = classify(
            step=step,
            table=[{**a, **b} for a, b in zip(table1, table2, strict=True)],
            suspect=suspect,
            witness=witness,
            tolerance=tolerance,
            source=source,
        )
    t_checked = time.perf_counter()
    # 5. Back to the boundary before `step`; the answer.
    _back_to_boundary(guard, heavy, mark)
    if unread:
        guard.cursor.unread(unread)
    if guard.checkpoints is not None:
        guard.checkpoints.retire_after(step)
    t_end = time.perf_counter()
    verdict["replay_s"] = round(t_end - t0, 4)
    verdict["evidence"]["replay_s"] = verdict["replay_s"]
    # Where the time went here: back to the step (the state broadcast included), the re-run
    # with the all-reduce and its gather, the check alone and its gather, back again.
    verdict["phases_s"] = {
        name: round(b - a, 4)
        for name, a, b in (
            ("restore", t0, t_restored),
            ("same_step", t_restored, t_again),
            ("alone", t_again, t_checked),
            ("back", t_checked, t_end),
        )
    }
    replays.hold = Hold(command.decision_id, time.monotonic())
    log.info("replay", rank=me, step=step, kind=verdict["kind"], suspect=verdict["rank"],
             seconds=verdict["replay_s"])  # fmt: skip
    return {"verdict": verdict, "detail": verdict["reason"]}


def _holdings(replays: Replays) -> dict[str, Any]:
    return {
        "kept": [k.snapshot.step for k in replays.kept],
        "marks": [m.step for m in replays.marks],
    }


def _choose_step(asked: int, table: list[dict[str, Any]]) -> int | None:
    """The anomaly's step when a rank kept it, else the newest later step one did (a rank that
    is persistently bad flags every step); every rank must still have the step's mark."""
    kept = {s for row in table for s in row["kept"]}
    usable = sorted(s for s in kept if all(s in row["marks"] for row in table))
    if asked in usable:
        return asked
    later = [s for s in usable if s > asked]
    return later[-1] if later else None


def _unread(replays: Replays, step: int) -> list[tuple[int, Any]]:
    """The batches of `step` and later that a plain iterable yielded (to be read again)."""
    return [(m.batch_index, m.batch) for m in replays.marks if m.step >= step]


def _to_boundary(guard: Guard, heavy: Snapshot, mark: StepMark) -> None:
    """Put this rank at the boundary before `mark.step`: shared state from `heavy`, its own
    RNGs and data position from `mark`."""
    guard.restore(
        dataclasses.replace(
            heavy, step=mark.step, tick=guard.tick, cursor=mark.cursor, rng=mark.rng
        )
    )


def _same_step(guard: Guard, mark: StepMark) -> tuple[Any, int, dict[str, Any] | None, _Run | None]:
    """Re-run the step of `mark` as it ran (all-reduce included): (batch, index, the RNG state
    its forward started from, its numbers or None if it failed here)."""
    try:
        if guard.cursor.rewindable:
            index, batch = guard.cursor.next()  # from the restored boundary, as the original
        else:
            index, batch = mark.batch_index, mark.batch
            assert mark.forward_rng is not None
            restore_rng(mark.forward_rng)
        forward_rng = capture_rng()
        run = _run(guard, batch, index, model=guard.model)
    except Exception as exc:  # a peer must learn of it at the next gather, not hang
        log.exception("replay_failed", step=mark.step)
        del exc
        return None, mark.batch_index, None, None
    return batch, index, forward_rng, run


def _back_to_boundary(guard: Guard, heavy: Snapshot, mark: StepMark) -> None:
    """Back to the boundary `_to_boundary` put this rank at, after re-runs, which changed no
    weight or optimizer state: only gradients, buffers (batch-norm statistics), the scaler's
    iteration, the RNGs and the data position."""
    guard.optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for name, buf in guard.model.named_buffers():
            saved = heavy.model.get(name)
            if isinstance(saved, torch.Tensor) and saved.shape == buf.shape:
                buf.copy_(saved)
    if guard.scaler is not None and heavy.scaler is not None:
        guard.scaler.load_state_dict(heavy.scaler)
    restore_rng(mark.rng)
    guard.step_count = mark.step
    guard.cursor.seek(mark.cursor)


def _alone(guard: Guard, heavy: Snapshot, mark: StepMark, sent: Any) -> _Run | None:
    """Re-run the suspect's batch on this rank alone (no all-reduce), from the same state."""
    batch, index, rng, factor = sent
    try:
        _back_to_boundary(guard, heavy, mark)
        restore_rng(rng)
        with guard.injector.data_factor_of(factor):
            return _run(
                guard, _to_device(batch, guard.device), index, model=unwrap_ddp(guard.model)
            )
    except Exception:
        log.exception("replay_failed", step=mark.step)
        return None


def _run(guard: Guard, batch: Any, index: int, *, model: torch.nn.Module) -> _Run:
    """Forward, backward and the gradients as the optimizer would see them (fault hooks on)."""
    guard.optimizer.zero_grad(set_to_none=True)
    guard.set_batch_index(index)
    loss = guard.forward_backward(batch, model=model)
    guard.finish_grads()
    grads = digest(_grads(guard)[0])
    loss_v = float(loss)
    if guard.scaler is not None and guard.executor.scaled:
        guard.scaler.update()  # ends the scaler's iteration; its state is restored after
    return _Run(loss_v, grads)


def _fail_if_any(
    guard: Guard, heavy: Snapshot, mark: StepMark, table: list[dict[str, Any]], what: str
) -> None:
    failed = [r for r, row in enumerate(table) if row.get("error")]
    if failed:
        _to_boundary(guard, heavy, mark)
        ranks = ", ".join(map(str, failed))
        raise ActionError(
            f"{what} of step {mark.step} failed on rank(s) {ranks}; nothing concluded"
        )


def _suspect(table: list[dict[str, Any]]) -> int:
    """The rank whose batch the witness re-runs: where the evidence points first.

    A rank whose loss moved on the re-run (its forward went wrong), one whose
    reduced gradient differs from its replicas', one whose gradients moved, one
    whose loss a detector flagged, else the lowest rank that kept the state.
    """
    holders = [r for r, row in enumerate(table) if row["kept"]]
    runs = {r: (_unpack(row["orig"]), _unpack(row["replay"])) for r, row in enumerate(table)}

    def moved(r: int, what: str) -> bool:
        orig, again = runs[r]
        if orig is None or again is None:
            return False
        if what == "loss":
            return not same_number(orig.loss, again.loss)
        return orig.grads.bits != again.grads.bits

    for r in holders:
        if moved(r, "loss"):
            return r
    bits = {r: again.grads.bits for r, (_, again) in runs.items() if again is not None}
    odd = odd_ones(bits, holders)
    if odd:
        return odd[0]
    for r in holders:
        if moved(r, "grads"):
            return r
    for r in holders:
        if table[r]["flagged"] == "loss":
            return r
    return holders[0]


def _witness(suspect: int, world: int) -> int | None:
    """The peer that re-runs the suspect's batch: the lowest other rank (none alone)."""
    return next((r for r in range(world) if r != suspect), None)


def classify(
    *,
    step: int,
    table: Sequence[dict[str, Any]],
    suspect: int,
    witness: int | None,
    tolerance: float,
    source: int,
) -> dict[str, Any]:
    """The answer from every rank's numbers (pure: the same on every rank).

    `table[r]`: `kept` (rank r flagged the step and kept its state), `orig` and
    `replay` (packed `_Run`s: the original step, the re-run with the all-reduce),
    `checked` (the suspect's batch run alone, on the suspect and on the witness),
    `names` (parameter names, for the first gradient that differs).
    """
    runs = {r: (_unpack(row["orig"]), _unpack(row["replay"])) for r, row in enumerate(table)}
    names: list[str] = list(table[suspect].get("names") or [])
    holders = [r for r, row in enumerate(table) if row["kept"]]
    again_of = {r: again for r, (_, again) in runs.items() if again is not None}
    odd = odd_ones({r: again.grads.bits for r, again in again_of.items()}, holders)
    if tolerance > 0 and odd:
        # Within the tolerance the replicas' re-runs may differ in their last bits.
        usual = again_of[min(r for r in again_of if r not in odd)]
        odd = [r for r in odd if not again_of[r].same(usual, tolerance)]
    mine, theirs = (
        _unpack(table[suspect]["checked"]),
        (_unpack(table[witness]["checked"]) if witness is not None else None),
    )
    moved = [
        r
        for r, (orig, again) in runs.items()
        if orig is not None and again is not None and not orig.same(again, tolerance)
    ]
    evidence: dict[str, Any] = {
        "step": step,
        "suspect": suspect,
        "witness": witness,
        "source": source,
        "tolerance": tolerance,
        "ranks": _evidence_rows(table, runs, [suspect, witness, *odd, *moved]),
    }
    if witness is not None and mine is not None and theirs is not None:
        evidence["witness_check"] = {
            "batch_of": suspect,
            "loss": [mine.loss, theirs.loss],
            "grads": [mine.grads.hex, theirs.grads.hex],
        }
    if (
        witness is not None
        and mine is not None
        and theirs is not None
        and not mine.same(theirs, tolerance)
    ):
        where = _where(names, mine.grads.first_difference(theirs.grads))
        evidence["first_difference"] = where
        reason = (
            f"rank {witness} re-ran rank {suspect}'s batch of step {step} from the same state "
            f"with the same RNG and got loss {theirs.loss:.6g}, gradients {theirs.grads.hex}; "
            f"rank {suspect} got loss {mine.loss:.6g}, gradients {mine.grads.hex}"
            f"{f' (first difference: {where})' if where else ''}: rank {suspect}'s chip is at fault"
        )
        return _verdict("replay_rank_specific", suspect, step, reason, evidence)
    if odd:
        bad = odd[0]
        ref = min(r for r in again_of if r not in odd)
        b, a = again_of[bad], again_of[ref]
        where = _where(names, a.grads.first_difference(b.grads))
        evidence["first_difference"] = where
        reason = (
            f"the replicas re-ran step {step} with the all-reduce and rank {bad}'s reduced "
            f"gradients ({b.grads.hex}) differ from rank {ref}'s ({a.grads.hex})"
            f"{f', first at {where}' if where else ''}; replicas must hold the same bits: "
            f"rank {bad}'s chip is at fault"
        )
        return _verdict("replay_rank_specific", bad, step, reason, evidence)
    if moved:
        rank = suspect if suspect in moved else moved[0]
        orig, again = runs[rank]
        assert orig is not None and again is not None
        where = _where(names, orig.grads.first_difference(again.grads))
        evidence["first_difference"] = where
        reason = (
            f"rank {rank}'s step {step} gave loss {orig.loss:.6g}, gradients {orig.grads.hex}; "
            f"re-run from the same state and batch it gives loss {again.loss:.6g}, gradients "
            f"{again.grads.hex}"
            + (f" (first difference: {where})" if where else "")
            + (
                f", and rank {witness} reproduces rank {suspect}'s batch"
                if witness is not None
                else ""
            )
            + ": a transient fault, hardware suspected"
        )
        return _verdict("replay_transient", rank, step, reason, evidence)
    orig, again = runs[suspect]
    numbers = (
        f"loss {again.loss:.6g}, gradients {again.grads.hex}" if again is not None else "the same"
    )
    reason = (
        f"step {step} re-run from the same state and batch gives the same numbers ({numbers})"
        + (f" and rank {witness} reproduces rank {suspect}'s batch" if witness is not None else "")
        + ": the data or the numerics, not a chip"
    )
    return _verdict("replay_reproducible", suspect, step, reason, evidence)


def _verdict(
    kind: str, rank: int, step: int, reason: str, evidence: dict[str, Any]
) -> dict[str, Any]:
    return {"kind": kind, "rank": rank, "step": step, "reason": reason, "evidence": evidence}


def _where(names: list[str], index: int | None) -> str | None:
    if index is None:
        return None
    return names[index] if index < len(names) else f"tensor {index}"


def _evidence_rows(
    table: Sequence[dict[str, Any]],
    runs: dict[int, tuple[_Run | None, _Run | None]],
    first: list[int | None],
) -> dict[str, Any]:
    """Per rank (the ranks that matter first, at most `EVIDENCE_RANKS`): the original and the
    re-run's loss and gradient digest."""
    order: list[int] = []
    for r in [*first, *range(len(table))]:
        if r is not None and r not in order:
            order.append(r)
    rows: dict[str, Any] = {}
    for r in order[:EVIDENCE_RANKS]:
        orig, again = runs[r]
        rows[str(r)] = {
            "kept": bool(table[r]["kept"]),
            "loss": [orig.loss if orig else None, again.loss if again else None],
            "grads": [orig.grads.hex if orig else None, again.grads.hex if again else None],
        }
    return rows


# ------------------------------------------------------------- collectives
def _gather(group: Any, obj: Any) -> list[Any]:
    """Every rank's `obj`, by rank of `group` (just `[obj]` alone)."""
    if group is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _broadcast(group: Any, obj: Any, src: int) -> Any:
    """`obj` of rank `src` of `group`, on every rank."""
    if group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, src), group=group)
    return box[0]


def _pack(run: _Run) -> dict[str, Any]:
    """A `_Run` as plain data for a gather (bit sums as Python ints)."""
    g = run.grads
    return {"loss": run.loss, "bits": list(g.per_tensor), "total": g.total, "mag": g.magnitude}


def _unpack(raw: dict[str, Any] | None) -> _Run | None:
    if raw is None:
        return None
    bits = tuple(int(b) for b in raw["bits"])
    return _Run(
        float(raw["loss"]), Digest(bits, fold(bits), float(raw["total"]), float(raw["mag"]))
    )


def _to_cpu(tree: Any) -> Any:
    return _map_tensors(tree, lambda t: t.detach().cpu())


def _to_device(tree: Any, device: torch.device) -> Any:
    return _map_tensors(tree, lambda t: t.to(device))


def _map_tensors(tree: Any, fn: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        items = [_map_tensors(v, fn) for v in tree]
        return items if isinstance(tree, list) else tuple(items)
    return tree
