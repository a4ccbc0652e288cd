"""Starting the run's node agents: one on every live node, and on nodes that join later.

`node_agents: auto` turns them on where the cluster has more than one node
(the spec's mode is resolved here, and the ranks' actors read it from the
spec). Placement is Ray's, so any node may get ranks: each live node gets an
agent at the start, and a node that joins the cluster afterwards gets one
within `NEW_NODES_S` (a lost node's replacements may be placed there), so its
ranks report through it, not to the supervisor directly. The handles are
shared with the worker group, which has an agent kill its node's ranks by pid.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray
import structlog

from remedy.protocol.spec import RunSpec
from remedy.rundir.writer import RunDir
from remedy.supervisor.agent.actor import alive_nodes, launch_agents
from remedy.supervisor.node_watch import ASK_TIMEOUT_S

log = structlog.get_logger("remedy.supervisor")

# How long the node agents may take to start.
AGENT_START_S = 120.0
# How often the supervisor looks for nodes that joined the cluster after its agents started.
NEW_NODES_S = 2.0


class NodeAgents:
    """The run's node agents: which nodes have one (or one starting) and their handles."""

    def __init__(self, spec: RunSpec, run_dir: RunDir) -> None:
        self.spec = spec
        self.run_dir = run_dir
        self.nodes: list[str] = []  # nodes with an agent of this run (or one starting)
        self.handles: dict[str, Any] = {}  # node id -> its agent, once started
        self._new_nodes_at = 0.0  # when to look for nodes that joined since (`for_new`)
        self._starting: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Resolve `node_agents` (auto: on with more than one node) and start them if on."""
        nodes = alive_nodes()
        mode = self.spec.node_agents
        on = mode == "on" or (mode == "auto" and len(nodes) > 1)
        self.spec.node_agents = "on" if on else "off"
        if not on:
            return
        self.nodes = nodes
        handles = launch_agents(self.spec.to_dict(), nodes)
        await asyncio.wait_for(
            asyncio.gather(*(h.where.remote() for h in handles.values())), AGENT_START_S
        )
        self.handles.update(handles)
        self.run_dir.history({"type": "agents_started", "nodes": nodes})

    async def for_new(self) -> None:
        """A node that joined the cluster since the agents started gets one too (every
        `NEW_NODES_S`), so that ranks placed there later (a lost node's replacements on the
        node that took its place) report through it, not to the supervisor directly."""
        if self.spec.node_agents != "on" or time.monotonic() < self._new_nodes_at:
            return
        self._new_nodes_at = time.monotonic() + NEW_NODES_S
        try:
            nodes = await asyncio.wait_for(asyncio.to_thread(alive_nodes), ASK_TIMEOUT_S)
        except (TimeoutError, ray.exceptions.RayError) as exc:
            log.warning("node_table_unread", error=repr(exc)[:200])
            return
        new = [n for n in nodes if n not in self.nodes]
        if not new:
            return
        self.nodes.extend(new)  # not started twice while this one starts
        task = asyncio.ensure_future(self._start_late(new))
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _start_late(self, nodes: list[str]) -> None:
        handles = launch_agents(self.spec.to_dict(), nodes, agents=len(self.nodes))
        try:
            await asyncio.wait_for(
                asyncio.gather(*(h.where.remote() for h in handles.values())), AGENT_START_S
            )
        except (TimeoutError, ray.exceptions.RayError) as exc:
            # Looked for again at the next round; meanwhile its ranks report directly.
            for node in nodes:
                self.nodes.remove(node)
            log.warning("agents_not_started", nodes=nodes, error=repr(exc)[:200])
            return
        self.handles.update(handles)  # the group's too: it holds this dict
        log.info("agents_started", nodes=nodes, joined_late=True)
        self.run_dir.history({"type": "agents_started", "nodes": nodes, "joined_late": True})
