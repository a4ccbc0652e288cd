"""One real supervisor under the report traffic of many ranks: does it keep up, how fast does it answer?

A few sender actors each simulate many ranks. A simulated rank steps at
`--step-hz` (10 steps/s) and reports as the Guard does (`Guard._send`): one
metrics record per step, sent in a batch at most every `heartbeat_s` (0.5 s,
so ~5 records a batch), and at once when the step raised an anomaly or the
rank has outcomes to report. Anomalies come at `--event-every` seconds per
rank on average (Poisson): a share of them are `data_stall`, which the
policy answers with `dump_diagnostics` (a command to every rank, which each
applies at its tick and reports an outcome for, as a Guard does), the rest
`memory_growth`, which no rule matches. Batches have the exact shape the
Guard sends (incarnation, seq, token as `RayReporter` stamps them) and go
through Ray to one real `SupervisorActor` (real policy, real run directory:
every metrics record, anomaly and decision is written). The driver polls
`events()` every 0.5 s as `remedy run`'s display does.

Printed per rank count: batches/s and events/s the supervisor answered
(against what was offered), the round-trip time of a report (send -> reply:
queueing in the supervisor plus Ray) per window of the run, which is the
ingest lag (growing means it falls behind), the batches in flight at each
window's end, and the decision latency: from sending the batch with a
`data_stall` to that rank receiving the command in the reply (p50/p99), and
until every rank holds the command (bounded by the heartbeat). A rank count
is kept up with when the senders offered their whole load, every batch was
answered, the lag does not grow over the run and the decision p99 is below
100 ms.

`--profile N` replays the same traffic of N ranks into the supervisor's own
class in this process (no Ray transport) under cProfile and prints the cost
per batch of each stage of `report`.

`--agents` sends the ranks' reports through node agents instead (one per
`--ranks-per-node` ranks, a digest per agent every `--digest-s`, or as
often as its ranks report where that is longer; see
`agent_hosts.py`, which says how many processes stand in for the agents),
prints the same figures for the supervisor, and projects 16,384 ranks from
the CPU the supervisor spent per agent call. `--ray-floor` runs each level
again against an actor whose calls return at once: the CPU per call that is
Ray's alone. `--direct 512` runs that many ranks reporting straight to the
supervisor first, with the same traffic, and prints the supervisor's CPU
both ways at each rank count and their ratio (what the agents save it):
measured where both were run, projected (and labelled so) where the
direct level was not. `--probe-nodes K` times the decisions from K nodes run in a
process of their own, the only ones raising anomalies (see `agent_hosts.py`).

    python benchmarks/supervisor_load.py [--ranks 64,256,1024] [--seconds 30] [--search]
    python benchmarks/supervisor_load.py --profile 1024
    python benchmarks/supervisor_load.py --agents --ranks 512,4096 --heartbeat-s 1 --step-hz 2
    python benchmarks/supervisor_load.py --agents --direct 512 --ranks 512,4096 --seconds 110 \
        --heartbeat-s 1 --step-hz 2 --events-per-s 4
    python benchmarks/supervisor_load.py --agents --ranks 4096 --seconds 110 --heartbeat-s 1 \
        --step-hz 2 --events-per-s 4 [--probe-nodes 8]
    python benchmarks/supervisor_load.py --agents --profile 4096 --seconds 10 --heartbeat-s 1 --step-hz 2
    python benchmarks/supervisor_load.py --agents --ray-floor --ranks 4096 --seconds 60 --heartbeat-s 1 \
        --step-hz 2 --events-per-s 3
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

from benchmarks._smoke import add_check_imports, check_imports
from benchmarks.agent_hosts import (
    actor_loop,
    agent_level,
    cpu_s,
    machine_cpu_s,
    replay_through_agents,
)
from remedy.protocol.spec import RunSpec
from remedy.supervisor.actor import SupervisorActor
from remedy.supervisor.agent.actor import digest_period
from remedy.supervisor.agent.core import paced_period

POLICY = """
version: 1
name: load-bench
rules:
  - name: stall-diagnostics
    when: {anomaly: data_stall}
    group_by: [kind, step, rank]
    do:
      - dump_diagnostics
"""
WINDOW_S = 5.0
DISPLAY_POLL_S = 0.5  # runner.POLL_S


class SimRank:
    """One simulated rank: the Guard's batching, commands applied and answered like a Guard's."""

    def __init__(self, rank: int, *, token: str, seed: int, cfg: dict[str, float]) -> None:
        self.rank, self.token = rank, token
        self.rng = random.Random(seed)
        self.heartbeat_s = cfg["heartbeat_s"]
        self.event_p = 1.0 / (cfg["event_every_s"] * cfg["step_hz"])
        self.match_share = cfg["match_share"]
        self.step = self.tick = self.seq = 0
        self.last_send = -1e9
        self.metrics: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.outcomes: list[dict[str, Any]] = []
        self.queued: dict[str, dict[str, Any]] = {}
        self.done: set[str] = set()

    def advance(self, now: float, wall: float) -> tuple[dict[str, Any] | None, int | None]:
        """One step; returns (the batch to send now or None, the step of a matching anomaly in it)."""
        for cid, cmd in list(self.queued.items()):  # apply due commands at this boundary
            if cmd["apply_at_tick"] <= self.tick:
                del self.queued[cid]
                self.done.add(cid)
                self.outcomes.append({"decision_id": cid, "rank": self.rank, "outcome": "applied",
                                      "step": self.step, "tick": self.tick, "detail": "",
                                      "result": {}, "attempts": 1})  # fmt: skip
        self.metrics.append({
            "step": self.step, "tick": self.tick, "rank": self.rank,
            "loss": 2.5 + self.rng.random() * 0.01, "grad_norm": 1.0 + self.rng.random() * 0.1,
            "lr": 3e-4, "loss_scale": None, "step_time_s": round(0.09 + self.rng.random() * 0.01, 6),
            "loader_time_s": 0.001, "mem_bytes": 123_456_789, "batch_index": self.tick,
            "optimizer_skipped": False,
        })  # fmt: skip
        matched = None
        if self.rng.random() < self.event_p:
            match = self.rng.random() < self.match_share
            self.events.append({
                "kind": "data_stall" if match else "memory_growth", "rank": self.rank,
                "step": self.step, "tick": self.tick, "value": 2.0, "threshold": 1.0,
                "severity": "warning", "source": "detector", "ts": wall,
                "details": {"window": 20},
            })  # fmt: skip
            matched = self.step if match else None
        self.step += 1
        self.tick += 1
        force = bool(self.events or self.outcomes)
        if not force and now - self.last_send < self.heartbeat_s:
            return None, None
        self.seq += 1
        batch = {
            "rank": self.rank, "step": self.step, "tick": self.tick, "ts": wall,
            "events": self.events, "metrics": self.metrics, "outcomes": self.outcomes,
            "max_steps": 10**6, "batch_size": 8, "incarnation": 1, "seq": self.seq,
        }  # fmt: skip
        if self.token:
            batch["token"] = self.token
        self.events, self.metrics, self.outcomes = [], [], []
        self.last_send = now
        return batch, matched

    def take(self, commands: list[dict[str, Any]]) -> list[str]:
        """The reply's commands; returns the ids this rank had not seen before."""
        new = []
        for cmd in commands:
            cid = cmd["decision_id"]
            if cid not in self.done and cid not in self.queued:
                self.queued[cid] = cmd
                new.append(cid)
        return new


@ray.remote(num_cpus=0)
class Sender:
    """Simulates a set of ranks on one event loop; measures what their reports cost."""

    async def run(self, supervisor: Any, ranks: list[int], seconds: float,
                  cfg: dict[str, float], token: str, pids: list[int]) -> dict[str, Any]:  # fmt: skip
        """Simulate `ranks` for `seconds`; the CPU of `pids` (and the machine) over that time."""
        sims = [SimRank(r, token=token, seed=r, cfg=cfg) for r in ranks]
        buckets = max(1, round(1.0 / (cfg["step_hz"] * 0.01)))  # 10 ms per bucket
        groups = [sims[i::buckets] for i in range(buckets)]
        self.windows: dict[int, dict[str, Any]] = {}
        self.decision_s: list[float] = []
        self.unanswered = 0  # batches with a matching anomaly whose reply had no new command
        self.receipts: dict[str, list[float]] = {}  # command id -> [first, last, ranks]
        self.pending = 0
        self.t0 = t0 = time.monotonic()
        cpu0 = [cpu_s(pid) for pid in pids] + [machine_cpu_s()]
        steps = late = 0
        k = 0
        tasks = set()
        while (now := time.monotonic()) - t0 < seconds:
            due = t0 + k * 0.01
            if due > now:
                await asyncio.sleep(due - now)
                now = time.monotonic()
            late = max(late, now - due)
            wall = time.time()
            for sim in groups[k % buckets]:
                batch, matched = sim.advance(now, wall)
                steps += 1
                if batch is not None:
                    ref = supervisor.report.remote(batch)
                    self._window(now)["sent"] += 1
                    self.pending += 1
                    task = asyncio.ensure_future(self._reply(sim, ref, now, matched))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            k += 1
        cpu = [cpu_s(pid) - c for pid, c in zip(pids, cpu0, strict=False)]
        cpu = [c / (time.monotonic() - t0) for c in [*cpu, machine_cpu_s() - cpu0[-1]]]
        if tasks:
            await asyncio.wait(tasks, timeout=30)
        return {
            "steps": steps, "seconds": time.monotonic() - t0, "max_late_s": late, "cpu": cpu,
            "windows": self.windows, "decision_s": self.decision_s, "unanswered": self.unanswered,
            "receipts": self.receipts, "pending": self.pending,
            "events": sum(w["events"] for w in self.windows.values()),
        }  # fmt: skip

    def _window(self, now: float) -> dict[str, Any]:
        w = int((now - self.t0) // WINDOW_S)
        return self.windows.setdefault(w, {"sent": 0, "answered": 0, "rtt": [], "events": 0,
                                           "in_flight": 0})  # fmt: skip

    async def _reply(self, sim: SimRank, ref: Any, sent: float, matched: int | None) -> None:
        commands = await ref
        now = time.monotonic()
        self.pending -= 1
        w = self._window(sent)
        w["answered"] += 1
        w["rtt"].append(now - sent)
        self._window(now)["in_flight"] = self.pending
        new = sim.take(commands)
        wall = time.time()
        for cid in new:
            r = self.receipts.setdefault(cid, [wall, wall, 0])
            r[0], r[1], r[2] = min(r[0], wall), max(r[1], wall), r[2] + 1
        if matched is not None:
            if any(c["anomaly_step"] == matched for c in commands if c["decision_id"] in new):
                self.decision_s.append(now - sent)
            else:
                self.unanswered += 1


def _pid(actor: Any) -> int:
    return int(ray.get(actor.__ray_call__.remote(lambda _self: os.getpid())))


def _profile_on(self: Any) -> None:
    # cProfile sees one thread: switch it on from inside the actor's event loop.
    self._bench_profile = cProfile.Profile()
    done = threading.Event()
    actor_loop().call_soon_threadsafe(lambda: (self._bench_profile.enable(), done.set()))
    done.wait(10)


def _profile_off(self: Any) -> str:
    done = threading.Event()
    actor_loop().call_soon_threadsafe(lambda: (self._bench_profile.disable(), done.set()))
    done.wait(10)
    out = io.StringIO()
    stats = pstats.Stats(self._bench_profile, stream=out)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(45)
    stats.print_callers("recv|_record|write|wal")
    return out.getvalue()


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def make_spec(tmp: Path, ranks: int) -> RunSpec:
    policy = tmp / "load.yaml"
    policy.write_text(POLICY)
    return RunSpec(target="bench.py:main", policy=str(policy), workers=ranks,
                   run_dir=str(tmp / "run"), spares=0)  # fmt: skip


def level(ranks: int, args: argparse.Namespace, cfg: dict[str, float]) -> dict[str, Any]:
    """One run of `ranks` simulated ranks; returns the figures and prints the lag table."""
    with tempfile.TemporaryDirectory() as tmp_s:
        spec = make_spec(Path(tmp_s), ranks)
        token = spec.token
        sup = SupervisorActor.remote(spec.to_dict())  # type: ignore[attr-defined]
        ray.get(sup.status.remote(token))
        n = max(1, min(args.senders, ranks))
        senders = [Sender.remote() for _ in range(n)]  # type: ignore[attr-defined]
        ray.get([s.__ray_ready__.remote() for s in senders])
        pids = [_pid(a) for a in (sup, *senders)]
        if args.actor_profile:
            ray.get(sup.__ray_call__.remote(_profile_on))
        # The first sender measures every process's CPU over its sending time.
        refs = [s.run.remote(sup, list(range(i, ranks, n)), args.seconds, cfg, token,
                             pids if i == 0 else [])
                for i, s in enumerate(senders)]  # fmt: skip
        cursor, polls, poll_s = 0, 0, []
        while True:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=DISPLAY_POLL_S)
            if len(ready) == len(refs):
                break
            t = time.monotonic()
            _, cursor = ray.get(sup.events.remote(cursor, token))
            poll_s.append(time.monotonic() - t)
            polls += 1
        results = ray.get(refs)
        cpu = results[0]["cpu"]
        status = ray.get(sup.status.remote(token))
        if args.actor_profile:
            print(ray.get(sup.__ray_call__.remote(_profile_off)))
        for actor in (sup, *senders):
            ray.kill(actor)
    windows: dict[int, dict[str, Any]] = {}
    for res in results:
        for w, d in res["windows"].items():
            agg = windows.setdefault(int(w), {"sent": 0, "answered": 0, "rtt": [], "events": 0,
                                              "in_flight": 0})  # fmt: skip
            for key in ("sent", "answered", "events", "in_flight"):
                agg[key] += d[key]
            agg["rtt"] += d["rtt"]
    receipts: dict[str, list[float]] = {}
    for res in results:
        for cid, (first, last, count) in res["receipts"].items():
            r = receipts.setdefault(cid, [first, last, 0])
            r[0], r[1], r[2] = min(r[0], first), max(r[1], last), r[2] + count
    fanout = [last - first for first, last, count in receipts.values() if count == ranks]
    decision = [s for res in results for s in res["decision_s"]]
    seconds = max(res["seconds"] for res in results)
    sent = sum(w["sent"] for w in windows.values())
    answered = sum(w["answered"] for w in windows.values())
    offered = ranks * cfg["step_hz"] * seconds
    steps = sum(res["steps"] for res in results)
    late_ms = max(r["max_late_s"] for r in results) * 1e3
    print(f"\n{ranks} ranks, {len(results)} senders, {seconds:.0f} s: {steps / seconds:.0f} steps/s "
          f"of {ranks * cfg['step_hz']:.0f} offered, senders at most {late_ms:.0f} ms late")  # fmt: skip
    print(f"  {'window':>8}{'sent/s':>9}{'answered/s':>12}{'rtt p50 ms':>12}{'p99 ms':>9}"
          f"{'max ms':>9}{'in flight':>11}")  # fmt: skip
    full = [w for w in sorted(windows) if (w + 1) * WINDOW_S <= seconds + 1e-6]
    for w in full:
        d = windows[w]
        print(f"  {w * WINDOW_S:>6.0f} s{d['sent'] / WINDOW_S:>9.0f}{d['answered'] / WINDOW_S:>12.0f}"
              f"{pct(d['rtt'], 0.5) * 1e3:>12.1f}{pct(d['rtt'], 0.99) * 1e3:>9.1f}"
              f"{max(d['rtt'], default=float('nan')) * 1e3:>9.1f}{d['in_flight']:>11}")  # fmt: skip
    # Lag grows if the later half of the sending windows answers slower than the earlier half
    # (warm-up skipped), or if the last one ends with more than a second of batches unanswered.
    sending = [w for w in full if (w + 1) * WINDOW_S <= args.seconds + 1e-6]
    body = sending[1:] if len(sending) > 2 else sending
    half = len(body) // 2 or 1
    early = [x for w in body[:half] for x in windows[w]["rtt"]]
    later = [x for w in body[half:] for x in windows[w]["rtt"]] or early
    last = windows[body[-1]] if body else {"in_flight": 0, "sent": 0}
    growing = bool(
        pct(later, 0.5) > 2 * pct(early, 0.5) + 0.010 or last["in_flight"] > last["sent"] / WINDOW_S
    )
    figures = {
        "ranks": ranks,
        "batches_s": answered / seconds,
        "events_s": sum(status["anomalies"].values()) / seconds,
        "offered_share": steps / offered,
        "unanswered_batches": sent - answered,
        "growing": growing,
        "decision_p50": pct(decision, 0.5),
        "decision_p99": pct(decision, 0.99),
        "decisions": len(decision),
        "no_command": sum(res["unanswered"] for res in results),
        "fanout_p50": pct(fanout, 0.5),
        "fanout_p99": pct(fanout, 0.99),
        "fanouts": len(fanout),
        "rtt_p99": pct([x for w in body for x in windows[w]["rtt"]], 0.99),
        "rtts": sum(len(windows[w]["rtt"]) for w in body),
        "polls": len(poll_s),
        "load_average": os.getloadavg()[0],
        "rejected": status["rejected"],
        "display_poll_p99": pct(poll_s, 0.99),
        "cpu_per_batch": cpu[0] * args.seconds / max(answered, 1),
    }
    figures["keeps_up"] = bool(
        figures["offered_share"] >= 0.95
        and figures["unanswered_batches"] == 0
        and not growing
        and figures["decision_p99"] < 0.1
    )
    print(f"  answered {figures['batches_s']:.0f} batches/s, {figures['events_s']:.1f} events/s; "
          f"decision latency p50 {figures['decision_p50'] * 1e3:.1f} ms, p99 {figures['decision_p99'] * 1e3:.1f} ms "
          f"({len(decision)} decisions, {figures['no_command']} events without a command); "
          f"every rank holds it after p50 {figures['fanout_p50'] * 1e3:.0f} ms, "
          f"p99 {figures['fanout_p99'] * 1e3:.0f} ms (n={figures['fanouts']}); "
          f"report round trip p99 {figures['rtt_p99'] * 1e3:.1f} ms (n={figures['rtts']})")  # fmt: skip
    print(f"  CPU while sending (cores busy): supervisor {cpu[0]:.2f} "
          f"({figures['cpu_per_batch'] * 1e6:.0f} us per batch), senders {sum(cpu[1:-1]):.2f}, "
          f"whole machine {cpu[-1]:.2f} of {os.cpu_count()} "
          f"(load average {os.getloadavg()[0]:.1f})")  # fmt: skip
    print(f"  display poll p99 {figures['display_poll_p99'] * 1e3:.1f} ms (n={figures['polls']}); "
          f"lag growing: {growing}; "
          f"rejected: {status['rejected'] or 'none'}; keeps up: {figures['keeps_up']}")  # fmt: skip
    return figures


def replay(
    ranks: int, seconds: float, cfg: dict[str, float], prof: cProfile.Profile | None
) -> tuple[int, float]:
    """Feed `seconds` of `ranks` ranks' batches to the supervisor's class in this process.

    Returns (batches, seconds spent in `report`); `prof` profiles those calls only.
    """
    with tempfile.TemporaryDirectory() as tmp_s:
        spec = make_spec(Path(tmp_s), ranks)
        token = spec.token
        sup = SupervisorActor.__ray_actor_class__(spec.to_dict())  # type: ignore[attr-defined]
        sims = [SimRank(r, token=token, seed=r, cfg=cfg) for r in range(ranks)]
        n, spent = 0, 0.0

        async def run() -> None:
            nonlocal n, spent
            t = 0.0
            for _ in range(int(seconds * cfg["step_hz"])):
                t += 1.0 / cfg["step_hz"]
                for sim in sims:
                    batch, _ = sim.advance(t, time.time())
                    if batch is None:
                        continue
                    n += 1
                    start = time.perf_counter()
                    if prof is not None:
                        prof.enable()
                    reply = await sup.report(batch)
                    if prof is not None:
                        prof.disable()
                    spent += time.perf_counter() - start
                    sim.take(reply)

        asyncio.run(run())
        return n, spent


def profile(ranks: int, seconds: float, cfg: dict[str, float]) -> None:
    """Replay `seconds` of `ranks` ranks' traffic into the supervisor's class in-process, profiled."""
    n, plain = replay(ranks, seconds, cfg, None)
    print(f"\nin-process, {ranks} ranks, {seconds:.0f} simulated s: {n} batches, "
          f"{plain / n * 1e6:.0f} us per batch in report() ({n / plain:.0f} batches/s of one core)")  # fmt: skip
    prof = cProfile.Profile()
    n, total = replay(ranks, seconds, cfg, prof)
    stats = pstats.Stats(prof)
    print(f"profiled: {total / n * 1e6:.0f} us per batch; by stage (cumulative, profiled):")
    by_name: dict[str, float] = {}
    for (file, _line, name), (_cc, _nc, _tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        key = f"{Path(file).stem}.{name}"
        by_name[key] = max(by_name.get(key, 0.0), ct)
    stages = ["actor.report", "rank_slots.accept", "feed.observe", "metrics.observe",
              "metrics._checkpoint_age", "control.ingest", "report_validation.validate_batch",
              "control._metrics", "straggler.add", "rundir.metrics_many", "rundir.anomaly",
              "rundir.decision",
              "control._check_stragglers", "straggler.find_stragglers", "_engine.decide",
              "control.commands_for", "feed.decisions", "metrics.decisions", "hang_watch.beat",
              "metrics.set", "metrics.inc"]  # fmt: skip
    print(f"  {'stage':<34}{'us/batch':>10}{'share':>8}")
    base = by_name.get("actor.report", total)
    for stage in stages:
        if stage in by_name:
            ct = by_name[stage]
            print(f"  {stage:<34}{ct / n * 1e6:>10.1f}{ct / base:>8.1%}")
    stats.sort_stats("tottime").print_stats(12)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="64,256,1024")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--senders", type=int, default=2)
    p.add_argument("--step-hz", type=float, default=10.0)
    p.add_argument("--heartbeat-s", type=float, default=0.5)  # GuardConfig.heartbeat_s
    p.add_argument("--event-every", type=float, default=120.0, help="seconds per rank per event")
    p.add_argument("--match-share", type=float, default=0.5, help="events a rule answers")
    p.add_argument("--search", action="store_true", help="then find the largest count kept up with")
    p.add_argument("--actor-profile", action="store_true", help="cProfile the actor's loop")
    p.add_argument("--profile", type=int, default=0, help="profile N ranks in-process instead")
    p.add_argument("--agents", action="store_true", help="report through node agents")
    p.add_argument("--ray-floor", action="store_true",
                   help="--agents: each level against an actor that answers at once, too")  # fmt: skip
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--agent-hosts", type=int, default=2, help="processes running the agents")
    p.add_argument(
        "--digest-s",
        type=float,
        default=None,
        help="an agent's fixed digest period (default: a run's, agent.digest_period, or as "
        "often as its ranks report where that is longer)",
    )
    p.add_argument("--events-per-s", type=float, default=4.0, help="anomalies/s in all (--agents)")
    p.add_argument("--project", type=int, default=16384, help="ranks to project (--agents)")
    p.add_argument(
        "--task-events",
        choices=("off", "on"),
        default="off",
        help="--agents: Ray's task events for the supervisor's calls (a run's: off)",
    )
    p.add_argument("--hosts-nice", type=int, default=0,
                   help="--agents: run the agent hosts at this nice value, below the supervisor "
                        "(on a cluster the agents run on other nodes than the supervisor's)")  # fmt: skip
    p.add_argument("--probe-nodes", type=int, default=0,
                   help="--agents: this many nodes run in a process of their own and are the "
                        "only ones raising anomalies (at --events-per-s in all): the decisions "
                        "are timed from agents as idle as a real node's, not from a process "
                        "packing hundreds of agents (0: every node raises them)")  # fmt: skip
    p.add_argument("--hosts-freeze-s", type=float, default=0.0,
                   help="--agents: the agent hosts freeze their heap (gc.freeze) every this many "
                        "seconds, so that a collection never walks a heap of hundreds of agents, "
                        "which no real agent has (0: once, after setup)")  # fmt: skip
    p.add_argument("--gc-young", type=int, default=0,
                   help="--agents: the supervisor's youngest-generation GC threshold (a run's: "
                        "quiet_gc.GC_YOUNG)")  # fmt: skip
    p.add_argument("--direct", default="",
                   help="--agents: these rank counts reporting directly too, in the same run "
                        "and with the same traffic, for the supervisor's CPU per rank report "
                        "both ways")  # fmt: skip
    add_check_imports(p)
    args = p.parse_args()
    if args.check_imports:
        check_imports()
        return
    cfg = {"step_hz": args.step_hz, "heartbeat_s": args.heartbeat_s,
           "event_every_s": args.event_every, "match_share": args.match_share}  # fmt: skip
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False, logging_level="ERROR")  # fmt: skip
    if args.profile and args.agents:
        with tempfile.TemporaryDirectory() as tmp_s:
            spec = make_spec(Path(tmp_s), args.profile)
            replay_through_agents(args.profile, int(args.seconds), args, spec)
        return
    if args.profile:
        profile(args.profile, args.seconds, cfg)
        return
    if args.agents:
        agents_main(args, cfg)
        return
    rows = [level(int(r), args, cfg) for r in args.ranks.split(",")]
    if args.search:
        ok = max((r["ranks"] for r in rows if r["keeps_up"]), default=0)
        bad = min((r["ranks"] for r in rows if not r["keeps_up"] and r["ranks"] > ok), default=0)
        nxt = ok * 2 if not bad else (ok + bad) // 2
        while nxt and (not bad or bad - ok > max(64, ok // 8)):
            row = level(nxt, args, cfg)
            rows.append(row)
            ok, bad = (nxt, bad) if row["keeps_up"] else (ok, nxt)
            nxt = ok * 2 if not bad else (ok + bad) // 2
    # Every percentile with its sample count (n): a p99 of 8 samples is their maximum.
    print(f"\n{'ranks':>6}{'batches/s':>11}{'events/s':>10}{'rtt p99 ms':>12}{'(n)':>8}"
          f"{'decision p50':>14}{'p99 ms':>8}{'(n)':>6}{'all ranks p99':>15}{'(n)':>6}"
          f"{'growing':>9}{'keeps up':>10}{'load avg':>10}")  # fmt: skip
    for r in sorted(rows, key=lambda r: r["ranks"]):
        print(f"{r['ranks']:>6}{r['batches_s']:>11.0f}{r['events_s']:>10.1f}{r['rtt_p99'] * 1e3:>12.1f}"
              f"{r['rtts']:>8}{r['decision_p50'] * 1e3:>14.1f}{r['decision_p99'] * 1e3:>8.1f}"
              f"{r['decisions']:>6}{r['fanout_p99'] * 1e3:>15.0f}{r['fanouts']:>6}"
              f"{r['growing']!s:>9}{r['keeps_up']!s:>10}{r['load_average']:>10.1f}")  # fmt: skip
    kept = [r["ranks"] for r in rows if r["keeps_up"]]
    print(f"largest rank count kept up with: {max(kept) if kept else 'none'} (of those run)")
    # What limits one supervisor: its own CPU per report (Ray's share and remedy's together).
    busy = [r for r in rows if r["keeps_up"] and r["batches_s"] > 100]
    if busy:
        per_batch = statistics.median(r["cpu_per_batch"] for r in busy)
        per_rank = statistics.median(r["batches_s"] / r["ranks"] for r in busy)
        print(f"limit: the supervisor's process spends {per_batch * 1e6:.0f} us of CPU per report "
              f"(Ray's call handling plus remedy's ingest; --profile N gives remedy's part): one "
              f"core answers ~{1 / per_batch:.0f} batches/s, ~{1 / per_batch / per_rank:.0f} ranks "
              f"at {per_rank:.2f} batches per rank per second")  # fmt: skip


def agents_main(args: argparse.Namespace, cfg: dict[str, float]) -> None:
    """`--agents`: each rank count through node agents, then the summary and the projection;
    with `--direct`, those rank counts reporting directly too, and the supervisor's CPU per
    rank report both ways."""
    direct = []
    for ranks in (int(r) for r in args.direct.split(",") if r):
        # The same anomalies in all as through agents (`--events-per-s`), half of them answered.
        same = {**cfg, "event_every_s": ranks / args.events_per_s, "match_share": 0.5}
        print(f"\n{ranks} ranks reporting directly to the supervisor (no agents)")
        direct.append(level(ranks, args, same))
    rows = []
    for ranks in (int(r) for r in args.ranks.split(",")):
        with tempfile.TemporaryDirectory() as tmp_s:
            profile = (_profile_on, _profile_off) if args.actor_profile else None
            spec = make_spec(Path(tmp_s), ranks)
            rows.append(agent_level(ranks, args, spec, DISPLAY_POLL_S, profile))
        if args.ray_floor:
            with tempfile.TemporaryDirectory() as tmp_s:
                print("\nRay's floor: the same traffic into an actor whose calls do nothing")
                floor = agent_level(ranks, args, make_spec(Path(tmp_s), ranks), DISPLAY_POLL_S,
                                    floor=True)  # fmt: skip
            rows[-1]["floor_cpu_per_call"] = floor["sup_cpu_per_call"]
    # Every percentile with its sample count (n).
    print(f"\n{'ranks':>6}{'nodes':>7}{'sup CPU/s':>11}{'us/call':>9}{'calls/s':>9}"
          f"{'decision p50':>14}{'p99 ms':>8}{'(n)':>6}{'rtt p99 ms':>12}{'(n)':>7}"
          f"{'all ranks p99':>15}{'(n)':>5}{'growing':>9}")  # fmt: skip
    for r in rows:
        print(f"{r['ranks']:>6}{r['nodes']:>7}{r['sup_cpu']:>11.3f}{r['sup_cpu_per_call'] * 1e6:>9.0f}"
              f"{r['calls_s']:>9.0f}{r['decision_p50'] * 1e3:>14.1f}{r['decision_p99'] * 1e3:>8.1f}"
              f"{r['decisions']:>6}{r['rtt_p99'] * 1e3:>12.1f}{r['rtts']:>7}"
              f"{r['fanout_p99'] * 1e3:>15.0f}{r['fanouts']:>5}{r['growing']!s:>9}")  # fmt: skip
    for r in rows:
        if "floor_cpu_per_call" in r:
            print(f"{r['ranks']} ranks: {r['sup_cpu_per_call'] * 1e6:.0f} us of supervisor CPU per "
                  f"agent call, of which Ray's floor {r['floor_cpu_per_call'] * 1e6:.0f} us "
                  f"({r['floor_cpu_per_call'] / r['sup_cpu_per_call']:.0%})")  # fmt: skip
    if direct:
        # What agents save the supervisor: its CPU per rank report, direct against through them.
        print(f"\n{'ranks':>6}{'reporting':>11}{'reports/s':>11}{'sup CPU/s':>11}"
              f"{'us/report':>11}{'keeps up':>10}")  # fmt: skip
        for r in direct:
            print(f"{r['ranks']:>6}{'directly':>11}{r['batches_s']:>11.0f}"
                  f"{r['cpu_per_batch'] * r['batches_s']:>11.3f}{r['cpu_per_batch'] * 1e6:>11.0f}"
                  f"{r['keeps_up']!s:>10}")  # fmt: skip
        for r in rows:
            print(f"{r['ranks']:>6}{'agents':>11}{r['reports_s']:>11.0f}{r['sup_cpu']:>11.3f}"
                  f"{r['sup_cpu'] / r['reports_s'] * 1e6:>11.0f}{not r['growing']!s:>10}")  # fmt: skip
        # The supervisor's cores at the same rank count both ways: measured where the direct
        # level was run, else projected from the direct levels' cores per rank (linear: one
        # report per rank per heartbeat either way), and labelled so.
        per_rank = statistics.median(
            d["cpu_per_batch"] * d["batches_s"] / d["ranks"] for d in direct
        )
        for r in rows:
            same = next((d for d in direct if d["ranks"] == r["ranks"]), None)
            if same is not None:
                cores, how = same["cpu_per_batch"] * same["batches_s"], "measured"
            else:
                cores, how = per_rank * r["ranks"], "PROJECTED from the direct levels, not measured"
            print(f"{r['ranks']} ranks: the supervisor's CPU {cores:.3f} cores reporting directly "
                  f"({how}) against {r['sup_cpu']:.3f} through agents ({args.ranks_per_node} "
                  f"ranks a node): {cores / r['sup_cpu']:.1f}x less")  # fmt: skip
    big = max(rows, key=lambda r: r["ranks"])
    nodes = -(-args.project // args.ranks_per_node)
    digest_s = args.digest_s or paced_period(digest_period(nodes), args.heartbeat_s)
    calls = nodes / digest_s + big["event_calls_s"]
    print(f"\nPROJECTION (not measured) for {args.project} ranks on {nodes} nodes, from the "
          f"{big['ranks']}-rank run: {calls:.0f} agent calls/s ({nodes} digests per "
          f"{digest_s:g} s plus {big['event_calls_s']:.1f}/s with events) x "
          f"{big['sup_cpu_per_call'] * 1e6:.0f} us of supervisor CPU per call = "
          f"{calls * big['sup_cpu_per_call']:.2f} cores of the supervisor; each agent "
          f"{args.ranks_per_node / args.heartbeat_s * big['take_us'] * 1e-6:.4f} cores "
          f"({big['take_us']:.0f} us per report x {args.ranks_per_node / args.heartbeat_s:g} "
          f"reports/s), unchanged by the rank count")  # fmt: skip


if __name__ == "__main__":
    main()
