"""Rank and spare actors as Ray mechanism: names, creation, the spare pool, where each runs, kills.

Every actor is named and detached in the `remedy` namespace
(`remedy-rank-<run_id>-<rank>-i<incarnation>`, spares
`remedy-spare-<run_id>-<n>`), so it outlives a supervisor that crashes and a
restarted one finds it again by name. An actor is pinned to the node the
placement plan chose (`supervisor.placement`) by Ray's hard node affinity.

Mechanism only: nothing here writes a rank's slot (its incarnation, node and
pid belong to the run's record). `WorkerGroup` decides which rank gets which
actor and passes what is learnt here (`where`) on to the slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import ray
import structlog
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from remedy.control.hang_watch import DEAD
from remedy.protocol.exceptions import WaitTimeout
from remedy.protocol.spec import NAMESPACE, RunSpec
from remedy.supervisor import placement, waits
from remedy.supervisor.pings import SPARE_PING_S
from remedy.supervisor.rank import RankActor

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

log = structlog.get_logger("remedy.worker_group")

# How long a node's agent gets to promote a spare of its node (`NodeAgent.promote`: the lost
# process gone, within `agent.PROMOTE_GONE_S`; the spare's answer, within `pings.SPARE_PING_S`).
PROMOTE_S = 5.0


def rank_name(run_id: str, rank: int, incarnation: int) -> str:
    return f"remedy-rank-{run_id}-{rank}-i{incarnation}"


def spare_name(run_id: str, number: int) -> str:
    return f"remedy-spare-{run_id}-{number}"


def run_actor_names(run_id: str) -> list[str]:
    """The named rank and spare actors of `run_id` alive on the cluster."""
    prefixes = (f"remedy-rank-{run_id}-", f"remedy-spare-{run_id}-")
    found = ray.util.list_named_actors(all_namespaces=True)
    return sorted(
        a["name"]
        for a in found
        if isinstance(a, dict)
        and a.get("namespace") == NAMESPACE
        and a["name"].startswith(prefixes)
    )


def kill_run_actors(run_id: str) -> int:
    """Kill every rank and spare actor of `run_id` still alive; return how many."""
    killed = 0
    for name in run_actor_names(run_id):
        with contextlib.suppress(ValueError):  # gone meanwhile
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
            killed += 1
    return killed


def find_spares(run_id: str, in_use: set[str]) -> list[tuple[str, Any]]:
    """(name, actor) of each spare of `run_id` alive on the cluster whose name is not `in_use`."""
    prefix = f"remedy-spare-{run_id}-"
    found = []
    for name in run_actor_names(run_id):
        if name.startswith(prefix) and name not in in_use:
            with contextlib.suppress(ValueError):  # gone meanwhile
                found.append((name, ray.get_actor(name, namespace=NAMESPACE)))
    return found


def new_actor(spec: RunSpec, supervisor: Any, name: str, node: str | None, *, pin: bool) -> Any:
    """A detached `RankActor` named `name` for `spec`'s run; `pin`: held to `node`."""
    options: dict[str, Any] = {"name": name, "namespace": NAMESPACE, "lifetime": "detached"}
    if spec.gpus_per_rank:
        options["num_gpus"] = spec.gpus_per_rank
    if node is not None and pin:
        # Hard: Ray's soft affinity placed zero-CPU actors on other nodes than asked
        # (seen with Ray 2.60). An actor sent to a node that died before Ray knew fails,
        # and its replacement is placed again among the nodes alive then (`relaunch`).
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
    return RankActor.options(**options).remote(  # type: ignore[attr-defined]
        run_id=spec.run_id,
        run_dir=spec.run_dir,
        supervisor=supervisor,
        target=spec.target,
        argv=spec.argv,
        threads=spec.threads_per_rank,
        verbose=spec.verbose,
        token=spec.token,
        silence_s=spec.supervisor_timeout_s,
        node_agents=spec.node_agents == "on",
    )


def run_args(
    spec: RunSpec,
    rank: int,
    *,
    incarnation: int,
    store_addr: tuple[str, int],
    generation: int,
    adopt_from: int | None,
    resume_step: int | None,
    hold_on_flag: bool,
) -> dict[str, Any]:
    """The keyword arguments of `RankActor.run` that make an actor `rank`."""
    return {
        "rank": rank,
        "world_size": spec.workers,
        "store_addr": store_addr,
        "incarnation": incarnation,
        "generation": generation,
        "adopt_from": adopt_from,
        "faults": [f for f in spec.faults if f.get("rank", 0) in (None, rank)],
        "resume_step": resume_step,
        # What every rank's WorkerContext takes from the run, besides who it is.
        "hold_on_flag": hold_on_flag,
    }


def pick_node(
    cluster: Sequence[placement.Node], used: Iterable[str], *, home: str, avoid: set[str]
) -> str | None:
    """The least loaded node not in `avoid`; None on a one-node cluster (nothing is pinned)."""
    if len(cluster) <= 1:
        return None
    return placement.least_loaded(cluster, used, home=home, avoid=avoid)


async def answers(actor: Any, timeout_s: float) -> bool:
    """True if `actor` answers a ping within `timeout_s`."""
    try:
        await asyncio.wait_for(actor.ping.remote(), timeout_s)
    except (TimeoutError, ray.exceptions.RayError):
        return False
    return True


class Where(NamedTuple):
    """Where a rank actor's process runs, as it says (`RankActor.where`)."""

    address: str
    pid: int
    node: str | None  # its Ray node id (None: an actor of an older version says none)
    started: float  # the process's start time as psutil reads it (0.0: unknown)


async def where(
    actors: Mapping[int, Any], ranks: list[int], timeout_s: float
) -> tuple[dict[int, Where], BaseException | None]:
    """Where each of `ranks` runs, as each answered; and the first failure: a Ray error of an
    actor, else `WaitTimeout` naming those that did not answer in `timeout_s`. One rank's
    failure costs the others nothing."""

    async def ask(rank: int) -> Any:
        return await actors[rank].where.remote()  # caller bounds: asyncio.wait below

    calls = {asyncio.ensure_future(ask(r)): r for r in ranks}
    done, pending = await asyncio.wait(calls, timeout=timeout_s) if calls else (set(), set())
    for call in pending:
        call.cancel()
    failed: BaseException | None = None
    found: dict[int, Where] = {}
    for call in done:
        if call.exception() is not None:
            failed = failed or call.exception()
            continue
        answer = call.result()  # done
        found[calls[call]] = Where(
            answer[0],
            answer[1],
            str(answer[2]) if len(answer) > 2 else None,
            float(answer[3]) if len(answer) > 3 else 0.0,
        )
    if failed is None and pending:
        silent = sorted(calls[c] for c in pending)
        failed = WaitTimeout(f"ranks {silent} did not say where they run within {timeout_s:g}s")
    return found, failed


def ended(
    actors: Mapping[int, Any], following: set[int], calls: dict[int, tuple[Any, Any]]
) -> dict[int, Any]:
    """Ranks of `following` whose `run` ended: their summary, or `DEAD` if the actor is gone.

    Never waits: each rank has one `result` call out at a time (`calls`: rank -> the actor
    asked, its call), looked at here and sent again once answered None (still training).
    A rank that answers nothing (stopped, wedged) holds only its own call, not the
    supervisor's loop, and its calls do not pile up.
    """
    out: dict[int, Any] = {}
    for rank, (asked, _) in list(calls.items()):
        if rank not in following or asked is not actors.get(rank):
            del calls[rank]  # ended, killed or replaced: the call is stale
    for rank in sorted(following):
        actor = actors.get(rank)
        if actor is not None and rank not in calls:
            calls[rank] = (actor, actor.result.remote())
    refs = {ref: rank for rank, (_, ref) in calls.items()}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0) if refs else ([], [])
    for ref in ready:
        rank = refs[ref]
        del calls[rank]
        try:
            result = ray.get(ref)  # ready: ray.wait returned it
        except ray.exceptions.ActorUnavailableError:
            continue  # not known to be dead (`supervisor.pings`): asked again
        except ray.exceptions.RayActorError:
            result = DEAD
        except ray.exceptions.RayError:
            continue  # asked again next time
        if result is not None:
            out[rank] = result
    for rank in sorted(following - set(actors)):
        out[rank] = DEAD
    return out


def kill_process(
    actor: Any,
    pid: tuple[str, int, float] | None,
    *,
    node: str | None,
    home: str,
    here: str,
    agent: Any,
    token: Any,
) -> bool:
    """Kill a rank's process now; True if its node's `agent` was asked to.

    `pid`: (address, pid, start time) of the process; `node`: its Ray node id;
    `home`: the supervisor's node, `here` its address. By pid from this process on
    the supervisor's own node, by the node's agent on another (`NodeAgent.kill_rank`);
    through Ray everywhere. Ray's kill of a process on another node waits that node's
    raylet's `kill_worker_timeout_milliseconds` (5 s by default) for a stopped (hung)
    one, and its peers stay blocked in their collective until it is gone.
    """
    by_agent = False
    if pid is not None and agent is not None and pid[2]:
        agent.kill_rank.remote(token, pid[1], pid[2])
        by_agent = True
    elif pid is not None and (node == home or (node is None and pid[0] == here)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid[1], signal.SIGKILL)
    if actor is not None:
        ray.kill(actor, no_restart=True)
    return by_agent


def kill_quietly(actor: Any) -> None:
    """Kill `actor` (a spare left out), whether or not it is still there."""
    with contextlib.suppress(ray.exceptions.RayError, ValueError):
        ray.kill(actor, no_restart=True)


async def promote(
    agent: Any,
    token: Any,
    actor: Any,
    name: str,
    args: dict[str, Any],
    gone: tuple[str, int, float] | None,
    node: str | None,
) -> dict[str, Any] | None:
    """Ask `node`'s `agent` to make spare `name` (`actor`) a rank with `run` arguments `args`,
    once the lost process `gone` has ended (`NodeAgent.promote`). The agent's figures (how
    long the lost process took to go, and the whole), or None: not promoted, and the spare
    is killed."""
    pid, started = (gone[1], gone[2]) if gone is not None else (0, 0.0)
    try:
        # Not retried by Ray against a restarted agent: a spare whose `run` the crashed
        # agent may have started is killed below instead of being started twice.
        answer = await waits.within(
            agent.promote.options(max_task_retries=0).remote(token, name, args, pid, started),
            PROMOTE_S,
            f"agent of node {str(node)[:8]}: promote {name}",
        )
    except (WaitTimeout, ray.exceptions.RayError) as exc:
        answer = {"promoted": False, "why": str(exc)[:200]}
    if not (isinstance(answer, dict) and answer.get("promoted") is True):
        why = answer.get("why") if isinstance(answer, dict) else repr(answer)
        log.warning("spare_skipped", spare=name, rank=args["rank"], reason=f"not promoted: {why}")
        kill_quietly(actor)
        return None
    return {k: answer[k] for k in ("gone_s", "s", "still_there") if k in answer}


@dataclass
class Spares:
    """The warm spares of a run: actors started and warmed up before they are needed, each by
    name with the node it was placed on; `local` ones are kept on a node for its own ranks."""

    actors: list[Any] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    nodes: dict[str, str | None] = field(default_factory=dict)  # name -> node placed on
    local: set[str] = field(default_factory=set)  # of `names`, those kept for a node's ranks
    last: int = 0  # the number of the newest spare (`spare_name`)

    def add(self, actor: Any, name: str, node: str | None, *, local: bool = False) -> None:
        self.actors.append(actor)
        self.names.append(name)
        self.nodes[name] = node
        if local:
            self.local.add(name)

    def take(self, *, name: str | None = None, shun: set[str] | None = None) -> tuple[Any, str]:
        """Spare `name`; else the first spare not on a node of `shun`, else the first spare."""
        if name is not None:
            i = self.names.index(name)
        else:
            away = shun or set()
            i = next((i for i, n in enumerate(self.names) if self.nodes.get(n) not in away), 0)
        name = self.names.pop(i)
        self.nodes.pop(name, None)
        self.local.discard(name)
        return self.actors.pop(i), name

    async def take_answering(self, shun: set[str], skipped: list[str]) -> tuple[Any, str] | None:
        """(actor, name) of the first spare that answers a ping within `SPARE_PING_S`, those
        not on a node of `shun` first; each that does not is killed and named in `skipped`."""
        while self.names:
            actor, name = self.take(shun=shun)
            if await answers(actor, SPARE_PING_S):
                return actor, name
            log.warning(
                "spare_skipped", spare=name, reason=f"no answer to a ping within {SPARE_PING_S:g}s"
            )
            skipped.append(name)
            kill_quietly(actor)
        return None

    def local_on(self, node: str | None, *, any_node: bool) -> str | None:
        """The name of a local spare on `node` (`any_node`: a one-node cluster, any local one)."""
        return next(
            (n for n in self.names
             if n in self.local and (any_node or self.nodes.get(n) == node)),
            None,
        )  # fmt: skip

    def kept_on(self, node: str | None) -> int:
        """How many local spares are kept on `node` (None: on every node)."""
        return sum(1 for n in self.local if node is None or self.nodes.get(n) == node)

    def on_node(self, node: str) -> list[str]:
        return [n for n, at in self.nodes.items() if at == node]

    @property
    def apart(self) -> int:
        """How many spares stand in for any rank (not kept for a node's own)."""
        return len(self.actors) - len(self.local)

    def clear(self) -> list[Any]:
        """Forget every spare; their actors."""
        actors = list(self.actors)
        self.actors.clear()
        self.names.clear()
        self.nodes.clear()
        self.local.clear()
        return actors
