"""`supervisor_load.py --agents`: simulated ranks report through node agents to one real supervisor.

Each simulated node has 8 ranks (`--ranks-per-node`) and one agent: an
`AgentCore`, the per-report logic of `remedy.supervisor.agent.actor.NodeAgent`,
doing the token, slot, dedupe and validation work, keeping commands per
rank, and sending upward exactly what a node agent sends: each batch with an
anomaly at once (one `report_many` call), and one digest every `--digest-s`
seconds, or as often as its ranks report where that is longer, as a run's
agent paces itself (`AgentCore.digest_interval`; a `--digest-s` given is a
fixed period): one `report_many` call per
agent per interval, carrying every rank that reported, its outcomes too. The
agents' digests are spread evenly over the interval, as independent agents'
timers would be.

512 agent processes do not fit on a 2-core machine: `--agent-hosts`
processes (Ray actors) stand in for them, each running its share of the
agents and of their ranks on one event loop. The supervisor, a real
`SupervisorActor`, cannot tell: each agent makes its own Ray calls with its
own node name. A rank's report reaches its agent as a function call in the
host's process rather than a Ray call on its node: that hop's cost falls on
the node, never on the supervisor, and is left out of the latencies.

A simulated rank reports as the Guard does at `--heartbeat-s` (1 s here: one
report per rank per second) and applies each command at its tick; its
outcome goes with its next report (the agent sends it up with the next
digest either way). Anomalies come at `--events-per-s` in all, spread over
the ranks; half are `data_stall`, answered by `dump_diagnostics`, a command
to every rank.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import ray

from remedy.supervisor.agent.actor import digest_period
from remedy.supervisor.agent.core import AgentCore

WINDOW_S = 5.0


def cpu_s(pid: int | None = None) -> float:
    """CPU seconds of process `pid` (user + system), or of this process when None."""
    ticks = os.sysconf("SC_CLK_TCK")
    stat = Path(f"/proc/{pid or os.getpid()}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / ticks


def _cpu_seconds() -> list[float]:
    """The machine's CPU seconds by state, as /proc/stat's `cpu` line counts them (user,
    nice, system, idle, iowait, irq, softirq, steal, ...)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return [int(f) / os.sysconf("SC_CLK_TCK") for f in fields]


def machine_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (every state but idle and iowait; the
    time the hypervisor took for others, `steal_s`, included)."""
    return sum(s for i, s in enumerate(_cpu_seconds()) if i not in (3, 4))


def steal_s() -> float:
    """CPU seconds the hypervisor gave this virtual machine's cores to others (`steal` in
    /proc/stat): on a shared host, time every process here waited without running."""
    states = _cpu_seconds()
    return states[7] if len(states) > 7 else 0.0


class Rank:
    """One simulated rank: step records, Poisson anomalies, commands applied at their tick."""

    def __init__(self, rank: int, token: str, rng: random.Random, cfg: dict[str, float]) -> None:
        self.rank, self.token, self.rng = rank, token, rng
        self.step = self.seq = 0
        self.event_p = cfg["event_p"]
        self.steps_per_report = max(1, round(cfg["step_hz"] * cfg["heartbeat_s"]))
        self.queued: dict[str, dict[str, Any]] = {}
        self.done: set[str] = set()
        self.outcomes: list[dict[str, Any]] = []

    def report(self, wall: float) -> tuple[dict[str, Any], int | None]:
        """The steps since the last report; the batch, and the step of a matching anomaly."""
        metrics, events, matched = [], [], None
        for _ in range(self.steps_per_report):
            for cid, cmd in list(self.queued.items()):
                if cmd["apply_at_tick"] <= self.step:
                    del self.queued[cid]
                    self.done.add(cid)
                    self.outcomes.append({"decision_id": cid, "rank": self.rank,
                                          "outcome": "applied", "step": self.step,
                                          "tick": self.step, "detail": "", "result": {},
                                          "attempts": 1})  # fmt: skip
            metrics.append({"step": self.step, "tick": self.step, "rank": self.rank,
                            "loss": 2.5 + self.rng.random() * 0.01, "grad_norm": 1.0, "lr": 3e-4,
                            "step_time_s": round(0.09 + self.rng.random() * 0.01, 6),
                            "loader_time_s": 0.001, "mem_bytes": 123_456_789,
                            "batch_index": self.step, "optimizer_skipped": False})  # fmt: skip
            if self.rng.random() < self.event_p:
                match = self.rng.random() < 0.5
                events.append({"kind": "data_stall" if match else "memory_growth",
                               "rank": self.rank, "step": self.step, "tick": self.step,
                               "value": 2.0, "threshold": 1.0, "severity": "warning",
                               "source": "detector", "ts": wall,
                               "details": {"window": 20}})  # fmt: skip
                matched = self.step if match else matched
            self.step += 1
        self.seq += 1
        batch = {"rank": self.rank, "step": self.step, "tick": self.step, "ts": wall,
                 "events": events, "metrics": metrics, "outcomes": self.outcomes,
                 "max_steps": 10**6, "batch_size": 8, "incarnation": 1, "seq": self.seq,
                 "token": self.token}  # fmt: skip
        self.outcomes = []
        return batch, matched

    def take(self, commands: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The commands in an answer; returns those this rank had not seen."""
        new = []
        for cmd in commands:
            cid = cmd["decision_id"]
            if cid not in self.done and cid not in self.queued:
                self.queued[cid] = cmd
                new.append(cmd)
        return new


@ray.remote(num_cpus=0)
class AgentHost:
    """Runs many node agents and their ranks in one process (see the module docstring)."""

    async def run(self, supervisor: Any, nodes: list[list[int]], first_node: int,
                  seconds: float, cfg: dict[str, float], token: str, world: int,
                  pids: list[int]) -> dict[str, Any]:  # fmt: skip
        """Simulate `nodes` (each a list of ranks) for `seconds`; the figures of this host."""
        if cfg.get("nice"):  # `--hosts-nice N`: below the supervisor, as on a node of their own
            os.nice(int(cfg["nice"]))
        self.sup, self.token, self.t0 = supervisor, token, time.monotonic()
        self.t0_wall = time.time()
        # This host's garbage collections: a pause holds every simulated agent of the host.
        self.gc: list[tuple[int, float, float, int, float]] = []
        collected = gc_recorder(self.gc)
        gc.callbacks.append(collected)
        self.windows: dict[int, dict[str, Any]] = {}
        self.decision_s: list[float] = []
        self.decision_at: list[float] = []  # when each was sent, in seconds into the run
        self.no_command = 0
        self.receipts: dict[str, list[float]] = {}
        self.calls = {"digest": 0, "event": 0}
        self.items = 0
        self.take_s = 0.0
        self.events: set[asyncio.Future[None]] = set()  # immediate calls in flight
        self.taken = 0
        interval = cfg["digest_s"]
        agents = [AgentCore(node=f"sim-{first_node + i:04d}", token=token, world_size=world)
                  for i in range(len(nodes))]  # fmt: skip
        ranks = [[Rank(r, token, random.Random(r), cfg) for r in node] for node in nodes]
        # This process stands in for hundreds of agents' processes, each of which would hold
        # one node's ranks: what it built for all of them is frozen, so that its collections do
        # not walk a heap no real agent has (they paused it 100-245 ms at 4,096 ranks, and the
        # decisions in flight with it).
        gc.collect()
        gc.freeze()
        cpu0 = [cpu_s(p) for p in pids] + [cpu_s()]
        tasks = [asyncio.ensure_future(self._ranks(a, rs, seconds, cfg["heartbeat_s"], i / len(nodes)))
                 for i, (a, rs) in enumerate(zip(agents, ranks, strict=True))]  # fmt: skip
        tasks += [asyncio.ensure_future(self._digests(a, seconds, interval, i / len(nodes),
                                                      paced=bool(cfg["paced"])))
                  for i, (a, rs) in enumerate(zip(agents, ranks, strict=True))]  # fmt: skip
        rss0 = psutil.Process().memory_info().rss
        probe = asyncio.ensure_future(self._probe(seconds, cfg.get("freeze_s", 0.0)))
        await asyncio.gather(*tasks)
        probe.cancel()
        if self.events:
            await asyncio.wait(self.events, timeout=30)
        gc.callbacks.remove(collected)
        span = time.monotonic() - self.t0
        cpu = [(cpu_s(p) - c) / span for p, c in zip(pids, cpu0, strict=False)]
        cpu.append((cpu_s() - cpu0[-1]) / span)
        return {"seconds": span, "windows": self.windows, "decision_s": self.decision_s,
                "decision_at": self.decision_at,
                "no_command": self.no_command, "receipts": self.receipts, "calls": self.calls,
                "items": self.items, "cpu": cpu, "take_s": self.take_s, "taken": self.taken,
                "late": self.late, "gc": self.gc, "t0_wall": self.t0_wall,
                "rss": (rss0, psutil.Process().memory_info().rss),
                "rejected": sum(sum(a.rejected.values()) for a in agents)}  # fmt: skip

    async def _probe(self, seconds: float, freeze_s: float) -> None:
        """How late this host's own event loop runs (a 10 ms sleep's overshoot): a reply
        reaches a simulated agent only when its host's loop gets to it, so this is in every
        latency the host measures. `freeze_s` (`--hosts-freeze-s`): freeze the heap that
        often (the cyclic garbage frozen with it is never freed: the host's memory at the
        end says what that cost)."""
        self.late: list[float] = []
        end = self.t0 + seconds
        frozen = time.monotonic()
        while time.monotonic() < end:
            t = time.monotonic()
            await asyncio.sleep(0.01)
            self.late.append(time.monotonic() - t - 0.01)
            if freeze_s and t - frozen >= freeze_s:
                gc.freeze()
                frozen = t

    def _window(self, at: float) -> dict[str, Any]:
        w = int((at - self.t0) // WINDOW_S)
        return self.windows.setdefault(w, {"calls": 0, "rtt": [], "in_flight": 0})

    async def _call(
        self, agent: AgentCore, items: list[dict[str, Any]], kind: str
    ) -> dict[Any, Any]:
        sent = time.monotonic()
        self.calls[kind] += 1
        self.items += len(items)
        w = self._window(sent)
        w["calls"] += 1
        w["in_flight"] += 1
        reply = await self.sup.report_many.remote(self.token, agent.node, items)
        w["in_flight"] -= 1
        w["rtt"].append(time.monotonic() - sent)
        return reply if isinstance(reply, dict) else {}

    def _deliver(self, agent: AgentCore, rank: Rank) -> list[dict[str, Any]]:
        new = rank.take(agent.commands(rank.rank))
        wall = time.time()
        for cmd in new:
            r = self.receipts.setdefault(cmd["decision_id"], [wall, wall, 0])
            r[0], r[1], r[2] = min(r[0], wall), max(r[1], wall), r[2] + 1
        return new

    async def _ranks(self, agent: AgentCore, ranks: list[Rank], seconds: float,
                     heartbeat: float, phase: float) -> None:  # fmt: skip
        """Each rank reports every `heartbeat` seconds, the node's ranks spread over it."""
        k = 0
        start = self.t0 + phase * heartbeat
        while True:
            due = start + k * heartbeat / len(ranks)
            if due - self.t0 >= seconds:
                return
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            rank = ranks[k % len(ranks)]
            batch, matched = rank.report(time.time())
            t = time.perf_counter()
            taken = agent.take(batch)
            self.take_s += time.perf_counter() - t
            self.taken += 1
            if taken.item is not None:
                task = asyncio.ensure_future(self._event(agent, rank, taken.item, matched))
                self.events.add(task)
                task.add_done_callback(self.events.discard)
            else:
                self._deliver(agent, rank)
            k += 1

    async def _event(self, agent: AgentCore, rank: Rank, item: dict[str, Any],
                     matched: int | None) -> None:  # fmt: skip
        sent = time.monotonic()
        agent.answered(await self._call(agent, [item], "event"))
        new = self._deliver(agent, rank)
        if matched is not None:
            if any(c["anomaly_step"] == matched for c in new):
                self.decision_s.append(time.monotonic() - sent)
                self.decision_at.append(sent - self.t0)
            else:
                self.no_command += 1

    async def _digests(self, agent: AgentCore, seconds: float, interval: float, phase: float,
                       *, paced: bool) -> None:  # fmt: skip
        due = self.t0 + (phase + 1) * interval
        while due - self.t0 < seconds + interval:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            items = agent.digest()
            if items:
                agent.answered(await self._call(agent, items, "digest"))
            # As a run's agent paces itself, unless --digest-s fixed the period.
            due += agent.digest_interval(interval) if paced else interval


def actor_loop() -> Any:
    """The running event loop of this (async) actor's process: where `report` runs."""
    # The supervisor froze the objects it was built with (`supervisor.quiet_gc`), the loop among
    # them, and `gc.get_objects` lists no frozen object: thaw, look, freeze again.
    gc.unfreeze()
    loops = [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop)]
    gc.freeze()
    return next(loop for loop in loops if loop.is_running())


def _probe_on(self: Any) -> None:
    """In the supervisor actor: measure how late its event loop runs (a 10 ms sleep's overshoot,
    which is what a call waits behind), and each garbage collection's pause, until `_probe_off`."""
    self._bench_late = []
    self._bench_gc = []
    self._bench_gc_callback = gc_recorder(self._bench_gc)
    gc.callbacks.append(self._bench_gc_callback)
    # Each state record's wall time (it runs on the loop: a call waiting for it waits all of
    # it) and its fsync's, with the wall time it ended and its CPU time: (record s, fsync s,
    # ended at, CPU s).
    self._bench_records = []
    fsyncs = [0.0]
    fsync, write_state = os.fsync, getattr(self, "write_state", None)

    def timed_fsync(fd: int) -> None:
        t = time.perf_counter()
        fsync(fd)
        fsyncs[0] += time.perf_counter() - t

    def timed_write(*, before_reply: bool = False) -> None:
        fsyncs[0] = 0.0
        t, c = time.perf_counter(), time.thread_time()
        assert write_state is not None
        write_state(before_reply=before_reply)
        self._bench_records.append(
            (time.perf_counter() - t, fsyncs[0], time.time(), time.thread_time() - c)
        )

    self._bench_unpatch = (fsync, write_state)
    if write_state is not None:  # not `--ray-floor`'s actor, which writes none
        os.fsync = timed_fsync
        self.write_state = timed_write

    async def probe() -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.01)
            self._bench_late.append(time.monotonic() - t - 0.01)

    done = threading.Event()
    loop = actor_loop()

    def start() -> None:
        self._bench_probe = loop.create_task(probe())
        done.set()

    loop.call_soon_threadsafe(start)
    done.wait(10)


def gc_recorder(out: list[tuple[int, float, float, int, float]]) -> Any:
    """A `gc.callbacks` entry appending (generation, pause in s, wall time it ended, objects
    it freed, the pause's CPU time in s) to `out`: a pause much longer than its CPU time
    is the process waiting for a core, not the collection's work."""
    began = [0.0, 0.0]

    def collected(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            began[0], began[1] = time.perf_counter(), time.thread_time()
        else:
            pause = time.perf_counter() - began[0]
            cpu = time.thread_time() - began[1]
            out.append((info["generation"], pause, time.time(), info["collected"], cpu))

    return collected


def _probe_off(self: Any) -> dict[str, list[Any]]:
    actor_loop().call_soon_threadsafe(self._bench_probe.cancel)
    gc.callbacks.remove(self._bench_gc_callback)
    os.fsync, write_state = self._bench_unpatch
    if write_state is not None:
        self.write_state = write_state
    intake = getattr(self, "intake", None)
    return {"late": list(self._bench_late), "gc": list(self._bench_gc),
            "records": list(self._bench_records),
            "intake": (intake.urgent_calls, intake.overtaken) if intake else None}  # fmt: skip


def _gc_young(_self: Any, threshold: int) -> None:
    gc.set_threshold(threshold, *gc.get_threshold()[1:])


def _pid(actor: Any) -> int:
    return int(ray.get(actor.__ray_call__.remote(lambda _self: os.getpid())))


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@ray.remote(num_cpus=0, enable_task_events=False)  # type: ignore[call-overload]
class NullSupervisor:
    """`--ray-floor`: answers the supervisor's calls at once, doing nothing, so the figures
    measured against it are Ray's share of a call alone."""

    def __init__(self, spec: dict[str, Any]) -> None:
        pass

    async def status(self, token: Any = None) -> dict[str, Any]:
        return {"rejected": {}, "actions": {}}

    async def events(self, cursor: int, token: Any = None) -> tuple[list[Any], int]:
        return [], cursor

    async def report_many(self, token: Any, node: Any, items: Any) -> dict[int, list[Any]]:
        return {}


def agent_level(
    ranks: int,
    args: Any,
    spec: Any,
    display_poll_s: float,
    profile: Any = None,
    *,
    floor: bool = False,
) -> dict[str, Any]:
    """One run of `ranks` ranks on `ranks / --ranks-per-node` simulated nodes; prints its table.

    `profile`: (on, off), called in the supervisor actor around the run (`--actor-profile`);
    what `off` returns is printed. `floor`: against `NullSupervisor` instead (`--ray-floor`)."""
    from remedy.supervisor.actor import SupervisorActor  # noqa: PLC0415 - after ray.init

    rpn = args.ranks_per_node
    nodes = [list(range(i, min(i + rpn, ranks))) for i in range(0, ranks, rpn)]
    hosts = max(1, min(args.agent_hosts, len(nodes)))
    # `--probe-nodes K`: the first K nodes run in a process of their own and are the only
    # ones raising anomalies (at the same rate in all), so the decisions are timed from
    # agents whose process is as idle as a real agent's, not one of hundreds of agents
    # packed in one process whose every pause holds them all.
    probe = min(max(0, getattr(args, "probe_nodes", 0)), len(nodes) - 1)
    digest_s = args.digest_s or digest_period(len(nodes))  # as a run's agents would
    cfg = {"step_hz": args.step_hz, "heartbeat_s": args.heartbeat_s, "digest_s": digest_s,
           "paced": args.digest_s is None, "nice": getattr(args, "hosts_nice", 0),
           "freeze_s": getattr(args, "hosts_freeze_s", 0.0),
           "event_p": args.events_per_s / (ranks * args.step_hz)}  # fmt: skip
    token = spec.token
    actor_class = NullSupervisor if floor else SupervisorActor
    task_events = getattr(args, "task_events", "off") == "on"
    # `--task-events on`: Ray's task events for the supervisor's calls, which a run leaves off.
    sup = actor_class.options(enable_task_events=task_events).remote(  # type: ignore[attr-defined]
        spec.to_dict()
    )
    ray.get(sup.status.remote(token))
    if getattr(args, "gc_young", 0):  # `--gc-young N`: the threshold the supervisor collects at
        ray.get(sup.__ray_call__.remote(_gc_young, args.gc_young))
    actors = [AgentHost.remote() for _ in range(hosts + bool(probe))]  # type: ignore[attr-defined]
    ray.get([a.__ray_ready__.remote() for a in actors])
    pids = [_pid(a) for a in (sup, *actors)]
    if profile is not None:
        ray.get(sup.__ray_call__.remote(profile[0]))
    ray.get(sup.__ray_call__.remote(_probe_on))
    # (first node, nodes, anomaly probability per rank step) of each host process.
    shares: list[tuple[int, list[list[int]], float]] = []
    if probe:
        event_p = args.events_per_s / (probe * rpn * args.step_hz)
        shares.append((0, nodes[:probe], event_p))
    rest = len(nodes) - probe
    per = -(-rest // hosts)
    shares += [(probe + i * per, nodes[probe + i * per : probe + (i + 1) * per],
                0.0 if probe else cfg["event_p"]) for i in range(hosts)]  # fmt: skip
    # The whole machine's busy CPU over the run: what the supervisor competes with here (the
    # agent hosts, Ray's own processes, the driver), which on a cluster runs elsewhere.
    busy0, stolen0, t0 = machine_cpu_s(), steal_s(), time.monotonic()
    refs = [a.run.remote(sup, share, first, args.seconds, cfg | {"event_p": p}, token, ranks,
                         pids if i == 0 else [])
            for i, (a, (first, share, p)) in enumerate(zip(actors, shares, strict=True))]  # fmt: skip
    cursor = 0
    while len(ray.wait(refs, num_returns=len(refs), timeout=display_poll_s)[0]) < len(refs):
        _, cursor = ray.get(sup.events.remote(cursor, token))  # as `remote run`'s display polls
    results = ray.get(refs)
    machine = (machine_cpu_s() - busy0) / (time.monotonic() - t0)
    stolen = (steal_s() - stolen0) / (time.monotonic() - t0)
    probed = ray.get(sup.__ray_call__.remote(_probe_off))
    sup_late, sup_gc, sup_records = probed["late"], probed["gc"], probed["records"]
    intake = probed["intake"]
    status = ray.get(sup.status.remote(token))
    if profile is not None:
        print(ray.get(sup.__ray_call__.remote(profile[1])))
    for actor in (sup, *actors):
        ray.kill(actor)
    seconds = max(r["seconds"] for r in results)
    cpu = results[0]["cpu"]  # supervisor, then each host (host 0 measured them all)
    windows: dict[int, dict[str, Any]] = {}
    for res in results:
        for w, d in res["windows"].items():
            agg = windows.setdefault(int(w), {"calls": 0, "rtt": [], "in_flight": 0})
            agg["calls"] += d["calls"]
            agg["in_flight"] += d["in_flight"]
            agg["rtt"] += d["rtt"]
    receipts: dict[str, list[float]] = {}
    for res in results:
        for cid, (first, last, count) in res["receipts"].items():
            r = receipts.setdefault(cid, [first, last, 0])
            r[0], r[1], r[2] = min(r[0], first), max(r[1], last), r[2] + count
    fanout = [last - first for first, last, count in receipts.values() if count == ranks]
    decision = [s for res in results for s in res["decision_s"]]
    calls = {k: sum(r["calls"][k] for r in results) for k in ("digest", "event")}
    taken = sum(r["taken"] for r in results)
    full = [w for w in sorted(windows) if (w + 1) * WINDOW_S <= args.seconds + 1e-6]
    body = full[1:] if len(full) > 2 else full
    half = len(body) // 2 or 1
    early = [x for w in body[:half] for x in windows[w]["rtt"]]
    later = [x for w in body[half:] for x in windows[w]["rtt"]] or early
    growing = bool(pct(later, 0.5) > 2 * pct(early, 0.5) + 0.010)
    print(f"\n{ranks} ranks on {len(nodes)} simulated nodes ({rpn} ranks each) through "
          f"{len(nodes)} agents, run by {hosts} host processes standing in for the {len(nodes)} "
          f"agents" + (f" at nice {cfg['nice']}" if cfg["nice"] else "")
          + (f", and 1 more process running the {probe} probe nodes ({probe * rpn} ranks), "
             f"the only ones raising anomalies (--probe-nodes): the decisions are timed "
             f"there" if probe else "")
          + f"; {seconds:.0f} s, 1 report per rank every {args.heartbeat_s:g} s, a digest per "
          f"agent every {digest_s:g} s" + (" or as often as its ranks report, if longer"
                                           if cfg["paced"] else " (fixed)"))  # fmt: skip
    print(f"  {'window':>8}{'calls/s':>9}{'rtt p50 ms':>12}{'p99 ms':>9}{'(n)':>7}"
          f"{'in flight':>11}")  # fmt: skip
    for w in full:
        d = windows[w]
        print(f"  {w * WINDOW_S:>6.0f} s{d['calls'] / WINDOW_S:>9.0f}{pct(d['rtt'], 0.5) * 1e3:>12.1f}"
              f"{pct(d['rtt'], 0.99) * 1e3:>9.1f}{len(d['rtt']):>7}{d['in_flight']:>11}")  # fmt: skip
    sup_calls = (calls["digest"] + calls["event"]) / seconds
    sup_cpu = cpu[0]
    host_cpu = sum(cpu[1:-1]) if len(cpu) > 2 else cpu[-1]
    figures = {
        "ranks": ranks, "nodes": len(nodes), "hosts": hosts, "probe_nodes": probe,
        "seconds": seconds,
        "reports_s": taken / seconds, "calls_s": sup_calls,
        "digest_calls_s": calls["digest"] / seconds, "event_calls_s": calls["event"] / seconds,
        "items_s": sum(r["items"] for r in results) / seconds,
        "sup_cpu": sup_cpu, "sup_cpu_per_call": sup_cpu / max(sup_calls, 1e-9),
        "host_cpu": host_cpu, "agent_cpu_per_report": host_cpu / max(taken / seconds, 1e-9),
        "take_us": sum(r["take_s"] for r in results) / max(taken, 1) * 1e6,
        "decision_p50": pct(decision, 0.5), "decision_p99": pct(decision, 0.99),
        "decisions": len(decision), "no_command": sum(r["no_command"] for r in results),
        "fanout_p99": pct(fanout, 0.99), "fanouts": len(fanout),
        "rtt_p99": pct([x for w in body for x in windows[w]["rtt"]], 0.99),
        "rtts": sum(len(windows[w]["rtt"]) for w in body), "growing": growing,
        "rejected": dict(status["rejected"]),
        "agent_rejected": sum(r["rejected"] for r in results),
        "outcomes": sum(status["actions"].values()), "load_average": os.getloadavg()[0],
        "machine_cpu": machine, "stolen_cpu": stolen,
        "host_late_p99": pct([x for r in results for x in r["late"]], 0.99),
        "sup_late_p99": pct(sup_late, 0.99), "sup_lates": len(sup_late),
        "sup_gc": {g: [x[1] for x in sup_gc if x[0] == g] for g in (0, 1, 2)},
        "host_lates": sum(len(r["late"]) for r in results),
    }  # fmt: skip
    print(f"  agents took {figures['reports_s']:.0f} reports/s; the supervisor answered "
          f"{sup_calls:.0f} calls/s ({figures['digest_calls_s']:.0f} digests, "
          f"{figures['event_calls_s']:.1f} with events) carrying {figures['items_s']:.0f} rank "
          f"items/s; decision latency p50 {figures['decision_p50'] * 1e3:.1f} ms, p99 "
          f"{figures['decision_p99'] * 1e3:.1f} ms (n={len(decision)}, {figures['no_command']} "
          f"events answered without their command); every rank holds a command after p99 "
          f"{figures['fanout_p99'] * 1e3:.0f} ms (n={len(fanout)}); agent call round trip p99 "
          f"{figures['rtt_p99'] * 1e3:.1f} ms (n={figures['rtts']})")  # fmt: skip
    # Where the tail is: the slowest decisions with the moment of the run they were sent in
    # (several in one window, with that window's round trips up too, is the machine stalling).
    sent_at = [(s, at) for res in results for s, at in zip(res["decision_s"], res["decision_at"],
                                                            strict=True)]  # fmt: skip
    slowest = sorted(sent_at, reverse=True)[:5]
    print(
        "  slowest decisions: " + ", ".join(f"{s * 1e3:.0f} ms at {at:.0f} s" for s, at in slowest)
    )
    print(f"  event loops running late (a 10 ms sleep's overshoot), p99: the supervisor's "
          f"{figures['sup_late_p99'] * 1e3:.1f} ms (n={figures['sup_lates']}), what a call waits "
          f"behind; the agent hosts' {figures['host_late_p99'] * 1e3:.1f} ms "
          f"(n={figures['host_lates']}), in every latency measured there")  # fmt: skip
    # A collection stops its process's loop for its whole pause: calls wait behind it. Pauses
    # over 50 ms with the second of the run they ended in, to set beside the slowest decisions.
    t0_wall = results[0]["t0_wall"]
    for who, pauses in (("the supervisor's", sup_gc),
                        ("the agent hosts'", [x for r in results for x in r["gc"]])):  # fmt: skip
        long = sorted((at - t0_wall, s, g, c) for g, s, at, _, c in pauses if s > 0.05)
        print(f"  {who} garbage collections: " + "; ".join(
            f"generation {g} {sum(1 for x in pauses if x[0] == g)}, longest "
            f"{max((x[1] for x in pauses if x[0] == g), default=0) * 1e3:.1f} ms, freeing "
            f"{statistics.median([x[3] for x in pauses if x[0] == g] or [0]):.0f} objects (median)"
            for g in (0, 1, 2))
            + "; over 50 ms: " + (", ".join(f"{s * 1e3:.0f} ms (gen {g}, CPU {c * 1e3:.0f}) at "
                                            f"{at:.0f} s" for at, s, g, c in long[:8])
                                  or "none"))  # fmt: skip
    # The state records (journal.wal, fsynced) on the supervisor's loop: a decision's reply
    # waits for one, and every call behind it waits too.
    if sup_records:
        took, synced = [x[0] for x in sup_records], [x[1] for x in sup_records]
        cpu_took = [x[3] for x in sup_records]
        long = sorted((at - t0_wall, s, f, c) for s, f, at, c in sup_records if s > 0.05)
        print(f"  the supervisor's state records: {len(took)}, p50 / p99 / longest "
              f"{pct(took, 0.5) * 1e3:.1f} / {pct(took, 0.99) * 1e3:.1f} / {max(took) * 1e3:.1f} "
              f"ms (CPU p50 / p99 {pct(cpu_took, 0.5) * 1e3:.1f} / {pct(cpu_took, 0.99) * 1e3:.1f}"
              f" ms), their fsync {pct(synced, 0.5) * 1e3:.1f} / {pct(synced, 0.99) * 1e3:.1f} / "
              f"{max(synced) * 1e3:.1f} ms; over 50 ms: " + (", ".join(
                  f"{s * 1e3:.0f} ms (fsync {f * 1e3:.0f}, CPU {c * 1e3:.0f}) at {at:.0f} s"
                  for at, s, f, c in long[:8]) or "none"))  # fmt: skip
    if intake is not None and intake[0]:
        print(f"  the supervisor's intake: {intake[0]} calls with anomalies, taken ahead of "
              f"{intake[1]} digests waiting ({intake[1] / intake[0]:.2f} a call)")  # fmt: skip
    rss = [r["rss"] for r in results]
    print(f"  the agent hosts' memory (RSS): {', '.join(f'{a / 2**20:.0f}' for a, _ in rss)} MiB "
          f"after setup, {', '.join(f'{b / 2**20:.0f}' for _, b in rss)} MiB at the end"
          + (f"; each froze its heap every {cfg['freeze_s']:g} s" if cfg["freeze_s"] else ""))  # fmt: skip
    print(f"  CPU (cores busy): supervisor {sup_cpu:.3f} ({figures['sup_cpu_per_call'] * 1e6:.0f} us "
          f"per agent call), the {len(actors)} agent hosts {host_cpu:.2f} "
          f"({figures['agent_cpu_per_report'] * 1e6:.0f} us per rank report, simulation included; "
          f"{figures['take_us']:.0f} us of it in the agent's own work); whole machine "
          f"{machine:.2f} of {os.cpu_count()} cores busy ({stolen:.2f} of them taken by the "
          f"hypervisor for other machines), load average "
          f"{figures['load_average']:.1f}; lag growing: {growing}; refused: supervisor "
          f"{figures['rejected'] or 'none'}, agents {figures['agent_rejected']}")  # fmt: skip
    return figures


def replay_through_agents(ranks: int, seconds: int, args: Any, spec: Any) -> None:
    """`--agents --profile N`: `seconds` of N ranks' traffic through agents into the supervisor's
    class in this process (no Ray transport): remedy's CPU per agent call, and its state records'
    share. Each simulated second: every rank's report, each immediate item, every agent's digest.
    Times are this thread's CPU time (`time.thread_time`): other processes on the machine
    do not inflate them.
    """
    from remedy.supervisor.actor import SupervisorActor  # noqa: PLC0415 - after ray.init

    cfg = {"step_hz": args.step_hz, "heartbeat_s": args.heartbeat_s,
           "event_p": args.events_per_s / (ranks * args.step_hz)}  # fmt: skip
    sup = SupervisorActor.__ray_actor_class__(spec.to_dict())  # type: ignore[attr-defined]
    write_state = sup.write_state
    spent = {"calls": 0, "report_many": 0.0, "write_state": 0.0, "writes": 0}
    reply_waits: list[float] = []  # the records a reply waited for, each one's CPU time

    def timed_write(*, before_reply: bool = False) -> None:
        t = time.thread_time()
        write_state(before_reply=before_reply)
        took = time.thread_time() - t
        spent["write_state"] += took
        spent["writes"] += 1
        if before_reply:
            reply_waits.append(took)

    sup.write_state = timed_write
    rpn = args.ranks_per_node
    agents = [AgentCore(node=f"sim-{i:04d}", token=spec.token, world_size=ranks)
              for i in range(-(-ranks // rpn))]  # fmt: skip
    sims = [[Rank(r, spec.token, random.Random(r), cfg)
             for r in range(i * rpn, min((i + 1) * rpn, ranks))] for i in range(len(agents))]  # fmt: skip

    async def call(agent: AgentCore, items: list[dict[str, Any]]) -> None:
        t = time.thread_time()
        reply = await sup.report_many(spec.token, agent.node, items)
        spent["report_many"] += time.thread_time() - t
        spent["calls"] += 1
        agent.answered(reply)

    async def run() -> None:
        for _ in range(seconds):
            for agent, rs in zip(agents, sims, strict=True):
                for rank in rs:
                    taken = agent.take(rank.report(time.time())[0])
                    if taken.item is not None:
                        await call(agent, [taken.item])
                    rank.take(agent.commands(rank.rank))
            for agent in agents:
                items = agent.digest()
                if items:
                    await call(agent, items)

    asyncio.run(run())
    per_call = spent["report_many"] / spent["calls"]
    print(f"\nin-process through agents, {ranks} ranks on {len(agents)} agents, {seconds} simulated "
          f"s: {spent['calls']} agent calls, {per_call * 1e6:.0f} us of remedy's CPU per call "
          f"({spent['report_many'] / seconds:.3f} s per simulated second); state records "
          f"{spent['writes']} ({spent['write_state'] / max(spent['writes'], 1) * 1e3:.1f} ms "
          f"each, {spent['write_state'] / spent['report_many']:.0%} of it); Ray's per-call "
          f"handling comes on top")  # fmt: skip
    if reply_waits:
        ordered = sorted(reply_waits)
        print(f"state records a reply waited for: {len(ordered)}, median "
              f"{ordered[len(ordered) // 2] * 1e3:.1f} ms, slowest {ordered[-1] * 1e3:.1f} ms "
              f"(full records only bound the journal's tail and are written off the reply "
              f"path)")  # fmt: skip
