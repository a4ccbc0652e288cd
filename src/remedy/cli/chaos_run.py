"""`remedy chaos run SCENARIO...`: each scenario against its job and against a fault-free twin.

A scenario is a chaos file (see `workers.chaos.Scenario`): its faults, and
optionally the job they hit (target, workers, steps, arguments, policy).
Every job runs under a real supervisor on one Ray (a private one unless
`--address` names a cluster), once with the faults and once without (the
twin, shared by the scenarios of the same job). For each fault the run
directory then says:

- whether and when it fired (its marker in `chaos/fired/`, or the first
  metrics record that carries it);
- whether it was detected: the first anomaly of the kinds that show it
  (`workers.chaos.FAULT_SIGNS`) at or after it fired, in steps and seconds
  after the fault; a killed supervisor is detected when Ray restarts it;
- the decisions taken on those anomalies, with their outcomes;
- the steps and seconds lost to those anomalies (the summary's `time_lost`);

and the scenario recovered when the run completed, no decision answering
a fault failed, every fault fired and the final loss is within the
scenario's `loss_tolerance` of the twin's. The table is printed and written
as JSON (`chaos-run.json` in the run directory); the exit status is 1 if any
scenario did not recover.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from remedy.control.goodput import when
from remedy.rank.chaos.faults import FAULT_SIGNS, ChaosSetting, Fault, Scenario, load_scenario
from remedy.rundir.writer import metrics_paths, read_jsonl

# The final loss may differ from the twin's by this fraction unless a scenario says otherwise.
DEFAULT_LOSS_TOLERANCE = 0.05
# A fault's marker is written just before it acts, and clocks of one machine agree:
# an anomaly this much before the fault's time may still be its sign.
CLOCK_SLACK_S = 0.5
SUPERVISOR_RESTART = "supervisor_restart"


def default_target() -> str | None:
    """The bundled GPT example, in a checkout of the repository (None where it is not)."""
    example = (
        Path(__file__).resolve().parents[3] / "examples" / "pretrain_gpt.py"
    )  # src/remedy/cli/
    return f"{example}:main" if example.is_file() else None


@dataclass(frozen=True)
class Job:
    """What a scenario runs: the same job with and without its faults."""

    target: str
    workers: int
    steps: int | None
    args: tuple[str, ...]
    policy: str

    def argv(self) -> list[str]:
        return [*self.args, *(["--steps", str(self.steps)] if self.steps else [])]

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "workers": self.workers, "steps": self.steps,
                "args": list(self.args), "policy": self.policy}  # fmt: skip


@dataclass
class Planned:
    scenario: Scenario
    job: Job
    name: str


@dataclass
class Outcome:
    """One scenario's result, a row of the table per fault."""

    name: str
    path: str
    description: str
    job: Job
    run_dir: str
    twin_dir: str
    status: str
    final_loss: float | None
    twin_final_loss: float | None
    loss_tolerance: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    twin: dict[str, Any] = field(default_factory=dict)

    @property
    def loss_delta(self) -> float | None:
        a, b = self.final_loss, self.twin_final_loss
        if a is None or b is None or not math.isfinite(a) or not b:
            return None
        return (a - b) / abs(b)

    @property
    def loss_ok(self) -> bool:
        delta = self.loss_delta
        return delta is not None and abs(delta) <= self.loss_tolerance

    @property
    def recovered(self) -> bool:
        return (
            self.status == "completed"
            and self.loss_ok
            and all(r["fired"] and r["recovered"] for r in self.rows)
        )

    def to_dict(self) -> dict[str, Any]:
        s = self.summary
        return {
            "scenario": self.name, "path": self.path, "description": self.description,
            "job": self.job.to_dict(), "run_dir": self.run_dir, "twin_dir": self.twin_dir,
            "status": self.status, "recovered": self.recovered,
            "final_loss": self.final_loss, "twin_final_loss": self.twin_final_loss,
            "loss_delta": None if self.loss_delta is None else round(self.loss_delta, 4),
            "loss_tolerance": self.loss_tolerance,
            "steps_executed": s.get("steps_executed"), "steps_kept": s.get("steps_kept"),
            "goodput": s.get("goodput"), "ettr": s.get("ettr"),
            "twin_ettr": self.twin.get("ettr"), "wall_s": s.get("wall_s"),
            "twin_wall_s": self.twin.get("wall_s"),
            "time_lost_by_cause": s.get("time_lost_by_cause", {}), "faults": self.rows,
        }  # fmt: skip


def plan(
    paths: list[str], *, target: str | None, workers: int | None
) -> tuple[list[Planned], list[str]]:
    """Every scenario read and checked before anything runs; (planned, error lines)."""
    from remedy.protocol.exceptions import TargetError  # noqa: PLC0415
    from remedy.rank.exceptions import ChaosConfigError  # noqa: PLC0415
    from remedy.rank.loop.target import check_target  # noqa: PLC0415

    planned: list[Planned] = []
    errors: list[str] = []
    names: dict[str, int] = {}
    for path in paths:
        try:
            first = load_scenario(path, setting=ChaosSetting(supervised=True))
            world = workers or first.workers or 1
            scenario = load_scenario(path, setting=ChaosSetting(supervised=True, world_size=world))
            goal = target or scenario.target or default_target()
            if goal is None:
                raise TargetError(f"{path}: no target: give --target or `target:` in the file")
            job = Job(
                target=check_target(goal), workers=world, steps=scenario.steps,
                args=scenario.args, policy=scenario.policy or "default",
            )  # fmt: skip
        except ChaosConfigError as exc:
            errors.extend(str(exc).splitlines())
            continue
        except TargetError as exc:
            errors.append(f"{path}: error: {exc}")
            continue
        stem = Path(path).stem
        names[stem] = names.get(stem, 0) + 1
        name = stem if names[stem] == 1 else f"{stem}-{names[stem]}"
        planned.append(Planned(scenario, job, name))
    return planned, errors


def run_all(
    planned: list[Planned],
    out_dir: Path,
    *,
    run: Callable[[Job, list[Fault], Path], dict[str, Any]],
    say: Callable[[str], None],
) -> list[Outcome]:
    """Run each scenario and its job's twin (once per job) with `run(job, faults, run_dir)`."""
    twins: dict[Job, tuple[Path, dict[str, Any]]] = {}
    outcomes = []
    for i, p in enumerate(planned, 1):
        if p.job not in twins:
            twin_dir = out_dir / f"twin-{len(twins) + 1}"
            say(f"chaos run: twin {len(twins) + 1} (no faults): {_job_text(p.job)}")
            twins[p.job] = (twin_dir, run(p.job, [], twin_dir))
        twin_dir, twin = twins[p.job]
        kinds = ", ".join(f"{f.kind}@{f.at_step}" for f in p.scenario.faults) or "no faults"
        say(f"chaos run: scenario {i}/{len(planned)} {p.name}: {kinds}")
        run_dir = out_dir / p.name
        summary = run(p.job, p.scenario.faults, run_dir)
        outcomes.append(analyze(p, run_dir, summary, twin_dir, twin))
    return outcomes


def _job_text(job: Job) -> str:
    return f"{Path(job.target.split(':')[0]).name} x{job.workers}, policy {job.policy}, " + (
        " ".join(job.argv()) or "no arguments"
    )


# ------------------------------------------------------------------ analysis
def analyze(
    p: Planned, run_dir: Path, summary: dict[str, Any], twin_dir: Path, twin: dict[str, Any]
) -> Outcome:
    """What the run directory says of each fault (see the module docstring)."""
    anomalies = sorted(read_jsonl(run_dir / "anomalies.jsonl"), key=lambda a: _at(a.get("ts")))
    decisions = read_jsonl(run_dir / "decisions.jsonl")
    metrics = [m for path in metrics_paths(run_dir) for m in read_jsonl(path)]
    history = read_jsonl(run_dir / "history.jsonl")
    fired = _fired(run_dir)
    restarts = [r["outage"] for r in history
                if r.get("type") == "supervisor_restored" and isinstance(r.get("outage"), dict)]  # fmt: skip
    used: set[int] = set()
    rows = []
    faults = sorted(p.scenario.faults, key=lambda f: f.at_step)
    for fault in faults:
        at = _fire_time(fault, p.job.workers, fired, metrics)
        row: dict[str, Any] = {
            "fault": fault.kind, "at_step": fault.at_step, "rank": fault.rank,
            "fired": at is not None, "detected": False, "detected_by": None,
            "detected_after_steps": None, "detected_after_s": None, "decisions": [],
            "recovered": False, "steps_lost": 0, "seconds_lost": 0.0,
        }  # fmt: skip
        reached = int(summary.get("steps_completed") or 0)
        if at is None and fault.at_step >= reached:
            row["not_reached"] = reached  # the run ended before the fault's step
        if at is not None:
            _detect(row, fault, at, anomalies, used, restarts)
            row["decisions"] = _answers(row, decisions)
            row["recovered"] = summary.get("status") == "completed" and all(
                d["outcome"] in ("applied", "dry_run", "suppressed") for d in row["decisions"]
            )
            causes = {*FAULT_SIGNS.get(fault.kind, ()), row["detected_by"]} - {None}
            lost = [r for r in summary.get("time_lost") or [] if r.get("cause") in causes]
            row["steps_lost"] = sum(int(r.get("steps") or 0) for r in lost)
            row["seconds_lost"] = round(sum(float(r.get("seconds") or 0) for r in lost), 3)
        rows.append(row)
    _share_lost(rows)
    return Outcome(
        name=p.name, path=p.scenario.path, description=p.scenario.description, job=p.job,
        run_dir=str(run_dir), twin_dir=str(twin_dir), status=str(summary.get("status")),
        final_loss=_loss(summary), twin_final_loss=_loss(twin),
        loss_tolerance=p.scenario.loss_tolerance if p.scenario.loss_tolerance is not None
        else DEFAULT_LOSS_TOLERANCE,
        rows=rows, summary=summary, twin=twin,
    )  # fmt: skip


def _fired(run_dir: Path) -> dict[str, tuple[float, dict[str, Any]]]:
    """Fired-fault markers by key: (when written, what they hold)."""
    out = {}
    for marker in (run_dir / "chaos" / "fired").glob("*.json"):
        try:
            data = json.loads(marker.read_text())
            out[marker.stem] = (marker.stat().st_mtime, data if isinstance(data, dict) else {})
        except (OSError, ValueError):
            continue
    return out


def _fire_time(
    fault: Fault,
    world: int,
    fired: dict[str, tuple[float, dict[str, Any]]],
    metrics: list[dict[str, Any]],
) -> float | None:
    """When `fault` first acted: its marker (once-per-run faults), else the first step record
    that carries it (window faults: their start)."""
    ranks = range(world) if fault.rank is None else [fault.rank]
    marks = [fired[fault.key(r)][0] for r in ranks if fault.key(r) in fired]
    if marks:
        return min(marks)
    for m in metrics:
        if m.get("rank") in ranks and any(
            isinstance(c, dict)
            and c.get("fault") == fault.kind
            and _num(c.get("step")) >= fault.at_step
            for c in m.get("chaos") or []
        ):
            return _num(m.get("t_end")) - _num(m.get("step_time_s")) - _num(m.get("loader_time_s"))
    return None


def _detect(
    row: dict[str, Any],
    fault: Fault,
    at: float,
    anomalies: list[dict[str, Any]],
    used: set[int],
    restarts: list[dict[str, Any]],
) -> None:
    if fault.kind == "kill_supervisor":
        back = [r for r in restarts if _num(r.get("back_at")) >= at - CLOCK_SLACK_S]
        if back:
            row.update(detected=True, detected_by=SUPERVISOR_RESTART,
                       detected_after_s=round(_num(back[0]["back_at"]) - at, 3))  # fmt: skip
        return
    signs = FAULT_SIGNS.get(fault.kind, ())
    for i, a in enumerate(anomalies):
        if i in used or a.get("kind") not in signs or _at(a.get("ts")) < at - CLOCK_SLACK_S:
            continue
        used.add(i)
        row.update(
            detected=True,
            detected_by=a["kind"],
            detected_event=(a.get("kind"), a.get("rank"), a.get("step")),
            detected_after_steps=max(int(_num(a.get("step"))) - fault.at_step, 0),
            detected_after_s=round(max(_at(a.get("ts")) - at, 0.0), 3),
        )
        return


def _answers(row: dict[str, Any], decisions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The decisions taken on the anomaly that detected the fault (a chain: every step)."""
    if not row["detected"] or row["detected_by"] == SUPERVISOR_RESTART:
        return []
    out = []
    for d in decisions:
        anomaly = d.get("anomaly") or {}
        if (anomaly.get("kind"), anomaly.get("rank"), anomaly.get("step")) == row.get(
            "detected_event"
        ):
            out.append({"action": d.get("action"), "outcome": d.get("outcome"),
                        "rule": d.get("rule")})  # fmt: skip
    return out


def _share_lost(rows: list[dict[str, Any]]) -> None:
    """Faults of one cause share what was lost to it: counted on the first such row only."""
    seen: set[str] = set()
    for row in rows:
        cause = row["detected_by"] or row["fault"]
        if cause in seen:
            row["steps_lost"], row["seconds_lost"], row["lost_shared"] = 0, 0.0, True
        seen.add(cause)
        row.pop("detected_event", None)


def _at(value: Any) -> float:
    """A journal line's time in seconds since the epoch (0 when it has none)."""
    return when(value) or 0.0


def _num(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return 0.0
    return float(value)


def _loss(summary: dict[str, Any]) -> float | None:
    loss = summary.get("final_loss")
    return float(loss) if isinstance(loss, int | float) and not isinstance(loss, bool) else None


# ------------------------------------------------------------------ output
COLUMNS = ("scenario", "fault", "detected", "decisions", "recovered", "lost", "final loss vs twin")


def table(outcomes: list[Outcome]) -> str:
    """The table a person reads: one line per fault, the scenario's figures on its first."""
    lines = []
    for o in outcomes:
        loss = "-"
        if o.final_loss is not None and o.twin_final_loss is not None:
            delta = o.loss_delta
            loss = f"{o.final_loss:.4f} vs {o.twin_final_loss:.4f}" + (
                f" ({delta:+.1%})" if delta is not None else ""
            )
        verdict = "yes" if o.recovered else f"NO ({_why_not(o)})"
        rows = o.rows or [{"fault": "(no faults)", "fired": True, "recovered": True}]
        for i, r in enumerate(rows):
            lines.append((
                o.name if i == 0 else "",
                _fault_text(r), _detected_text(r), _decisions_text(r),
                verdict if i == 0 else ("yes" if r.get("recovered") else "no"),
                _lost_text(r), loss if i == 0 else "",
            ))  # fmt: skip
    widths = [max(len(c), *(len(line[k]) for line in lines)) for k, c in enumerate(COLUMNS)]
    out = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths, strict=True))]
    out.extend(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )
    return "\n".join(out)


def _why_not(o: Outcome) -> str:
    if o.status != "completed":
        return f"run {o.status}"
    if any(not r["fired"] and r.get("not_reached") is not None for r in o.rows):
        return "a fault's step was past the run's last step"
    if any(not r["fired"] for r in o.rows):
        return "a fault never fired"
    if any(not r["recovered"] for r in o.rows):
        return "a decision failed"
    return f"loss off by more than {o.loss_tolerance:.0%}"


def _fault_text(r: dict[str, Any]) -> str:
    if "at_step" not in r:
        return str(r["fault"])
    rank = "every rank" if r.get("rank") is None else f"rank {r['rank']}"
    return f"{r['fault']} @{r['at_step']} {rank}"


def _detected_text(r: dict[str, Any]) -> str:
    if "at_step" not in r:
        return "-"
    if not r["fired"]:
        if r.get("not_reached") is not None:
            return f"never fired: the run ended after step {r['not_reached'] - 1}"
        return "never fired"
    if not r["detected"]:
        return "no"
    steps = r.get("detected_after_steps")
    after = f"+{steps} steps, " if steps is not None else ""
    return f"yes ({r['detected_by']}, {after}{r['detected_after_s']:.2f}s)"


def _decisions_text(r: dict[str, Any]) -> str:
    return ", ".join(f"{d['action']} ({d['outcome']})" for d in r.get("decisions") or []) or "-"


def _lost_text(r: dict[str, Any]) -> str:
    if "at_step" not in r:
        return "-"
    if r.get("lost_shared"):
        return "(with the row above)"
    return f"{r['steps_lost']} steps, {r['seconds_lost']:.2f}s"


def report(outcomes: list[Outcome], argv: list[str]) -> dict[str, Any]:
    """The table as JSON, with what reproduces it and the machine's load."""
    return {
        "command": "remedy " + " ".join(argv),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "recovered": all(o.recovered for o in outcomes),
        "scenarios": [o.to_dict() for o in outcomes],
    }


def main(args: Any, argv: list[str]) -> int:
    """`remedy chaos run`: plan, run on one Ray, print the table, write its JSON; the exit code."""
    from remedy.cli.cluster import ClusterError, choose, connect, disconnect  # noqa: PLC0415
    from remedy.cli.runner import run_supervised  # noqa: PLC0415
    from remedy.protocol.spec import RunSpec, new_run_id  # noqa: PLC0415

    planned, errors = plan(args.scenarios, target=args.target, workers=args.workers)
    if errors:
        for line in errors:
            print(line, file=sys.stderr)
        return 2
    out_dir = Path(args.run_dir or os.path.join("runs", f"chaos-{new_run_id()}")).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def run(job: Job, faults: list[Fault], run_dir: Path) -> dict[str, Any]:
        spec = RunSpec(
            target=job.target, policy=job.policy, workers=job.workers, run_dir=str(run_dir),
            faults=[f.model_dump() for f in faults], argv=job.argv(),
        )  # fmt: skip
        return run_supervised(spec)

    try:
        conn = connect(choose(args.address), workers=max(p.job.workers for p in planned))
    except ClusterError as exc:
        print(f"remedy: error: {exc}", file=sys.stderr)
        return 1
    try:
        outcomes = run_all(planned, out_dir, run=run, say=say)
    finally:
        disconnect(conn)
    print(table(outcomes))
    written = Path(args.json) if args.json else out_dir / "chaos-run.json"
    written.write_text(json.dumps(report(outcomes, argv), indent=2, default=str) + "\n")
    ok = all(o.recovered for o in outcomes)
    say(f"chaos run: {sum(o.recovered for o in outcomes)}/{len(outcomes)} scenarios recovered; "
        f"table in {written}")  # fmt: skip
    return 0 if ok else 1
