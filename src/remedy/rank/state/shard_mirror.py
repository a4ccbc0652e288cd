"""The buddy ring: each sharded rank's newest snapshot mirrored into the next rank's host memory.

Under FSDP no peer holds a lost rank's shard, so a replacement would have
only the disk to restore from. Each rank therefore sends its newest
snapshot to its buddy, rank `(r + 1) % world`, which keeps it in host
memory; the send runs on a helper thread over a gloo group of its own, so
the step neither waits for it nor meets its collectives. Snapshots are
host copies that the ring does not recycle for `snapshot_ring` snapshots,
so the helper packs straight from them: the training thread pays nothing
but the hand-over.

A packed snapshot is one flat byte buffer (every tensor and local shard,
in tree order) plus the pickled rest of the tree, where each tensor is a
placeholder (shape, dtype; for a shard also its global shape, stride and
placements). The receiver of a restore rebuilds it on its own device mesh
(`unpack`).

`restore_group` is what every rank of a new generation runs after a lost
rank was replaced (see `membership`): the replacement takes its shard from
its buddy, or under HSDP from a live replica peer; the survivors keep
their own (rolled back to the same step if the mirror is older than the
boundary); only when a replacement's buddy is lost too does every rank
load the newest committed DCP checkpoint. The result names the source.
"""

from __future__ import annotations

import datetime
import pickle
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
import torch
import torch.distributed as dist

from remedy.rank.loop import waits
from remedy.rank.state import restore_point, sharding, train_state
from remedy.rank.state.snapshots import Snapshot

if TYPE_CHECKING:
    from remedy.rank.guard import Guard

log = structlog.get_logger("remedy.shard_mirror")


@dataclass(frozen=True)
class _Slot:
    """A placeholder for one tensor of a packed tree."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    shard: tuple[Any, ...] | None = None  # (placements, global shape, stride) of a LocalShard


def pack(snap: Snapshot) -> tuple[bytes, torch.Tensor]:
    """(pickled tree with placeholders, one flat uint8 buffer of every tensor's bytes)."""
    tensors: list[torch.Tensor] = []

    def strip(tree: Any) -> Any:
        if isinstance(tree, sharding.LocalShard):
            tensors.append(tree.local)
            spec = (tree.placements, tuple(tree.shape), tree.stride)
            return _Slot(len(tensors) - 1, tuple(tree.local.shape), tree.local.dtype, spec)
        if isinstance(tree, torch.Tensor):
            tensors.append(tree)
            return _Slot(len(tensors) - 1, tuple(tree.shape), tree.dtype)
        if isinstance(tree, dict):
            return {k: strip(v) for k, v in tree.items()}
        if isinstance(tree, list | tuple):
            items = [strip(v) for v in tree]
            return items if isinstance(tree, list) else tuple(items)
        return tree

    meta = pickle.dumps(strip(snap.to_state()))
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    flat = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
    return meta, flat


def unpack(meta: bytes, flat: torch.Tensor, mesh: Any) -> Snapshot:
    """The snapshot `pack` made, its shards on `mesh` (this rank's device mesh)."""
    tree = pickle.loads(meta)
    slots: list[_Slot] = []

    def collect(node: Any) -> None:
        if isinstance(node, _Slot):
            slots.append(node)
        elif isinstance(node, dict):
            for v in node.values():
                collect(v)
        elif isinstance(node, list | tuple):
            for v in node:
                collect(v)

    collect(tree)
    slots.sort(key=lambda s: s.index)
    views: dict[int, torch.Tensor] = {}
    offset = 0
    for s in slots:
        nbytes = torch.Size(s.shape).numel() * torch.empty((), dtype=s.dtype).element_size()
        raw = flat[offset : offset + nbytes].clone()
        views[s.index] = raw.view(s.dtype).reshape(s.shape)
        offset += nbytes

    def fill(node: Any) -> Any:
        if isinstance(node, _Slot):
            t = views[node.index]
            if node.shard is None:
                return t
            placements, shape, stride = node.shard
            return sharding.LocalShard(t, mesh, placements, torch.Size(shape), stride)
        if isinstance(node, dict):
            return {k: fill(v) for k, v in node.items()}
        if isinstance(node, list | tuple):
            items = [fill(v) for v in node]
            return items if isinstance(node, list) else tuple(items)
        return node

    return Snapshot.from_state(fill(tree))


class ShardMirror:
    """This rank's side of the ring: send the newest snapshot to the buddy, hold the ward's."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.buddy = (rank + 1) % world_size  # holds this rank's snapshot
        self.ward = (rank - 1) % world_size  # whose snapshot this rank holds
        self._lock = threading.Lock()
        self.held: tuple[int, bytes, torch.Tensor] | None = None  # (step, meta, flat) of the ward
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="remedy-mirror")
        self._inflight: Future[None] | None = None
        self.sent_bytes = 0
        self.exchange_s: list[float] = []  # helper-thread seconds per exchange (pack + transfer)
        self.renew_group()

    def renew_group(self) -> None:
        """A new process-group generation: a fresh gloo group for the exchanges (a collective)."""
        self._pg = dist.new_group(backend="gloo")

    def push(self, snap: Snapshot) -> None:
        """Mirror `snap` to the buddy in the background (every rank at the same boundary).

        The previous exchange is awaited first: exchanges stay in order on every
        rank, and the buddy's copy is never more than one snapshot behind.
        """
        self.wait()
        self._inflight = self._pool.submit(self._exchange, snap, self._pg)

    def wait(self) -> None:
        if self._inflight is not None:
            try:
                waits.result(self._inflight, waits.MIRROR_S, "the shard mirror's exchange")
            except RuntimeError as exc:  # a peer was lost mid-exchange: recovery follows
                log.warning("mirror_exchange_failed", rank=self.rank, error=str(exc)[:200])
            self._inflight = None

    def _exchange(self, snap: Snapshot, pg: Any) -> None:
        t0 = time.perf_counter()
        meta, flat = pack(snap)
        meta_t = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
        sizes = torch.tensor([meta_t.numel(), flat.numel(), snap.step], dtype=torch.int64)
        theirs = torch.zeros(3, dtype=torch.int64)
        self._pair(sizes, theirs, pg)
        their_meta = torch.empty(int(theirs[0]), dtype=torch.uint8)
        their_flat = torch.empty(int(theirs[1]), dtype=torch.uint8)
        self._pair(meta_t, their_meta, pg)
        self._pair(flat, their_flat, pg)
        with self._lock:
            self.held = (int(theirs[2]), their_meta.numpy().tobytes(), their_flat)
        self.sent_bytes = flat.numel() + meta_t.numel()
        self.exchange_s.append(time.perf_counter() - t0)

    def _pair(self, send: torch.Tensor, recv: torch.Tensor, pg: Any) -> None:
        ops = [
            dist.P2POp(dist.isend, send, dist.get_global_rank(pg, self.buddy), pg),
            dist.P2POp(dist.irecv, recv, dist.get_global_rank(pg, self.ward), pg),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait(timeout=datetime.timedelta(seconds=waits.MIRROR_S))

    def held_step(self) -> int | None:
        with self._lock:
            return self.held[0] if self.held is not None else None

    def held_bytes(self) -> int:
        """Host memory this rank spends on its ward's mirrored snapshot."""
        with self._lock:
            return 0 if self.held is None else len(self.held[1]) + self.held[2].numel()

    def close(self) -> None:
        self.wait()
        waits.drain(self._pool, waits.MIRROR_S, "the shard mirror's pool")


def mirror_for(guard: Guard) -> ShardMirror | None:
    """A mirror for a sharded model in a process group of several ranks, else None."""
    if sharding.is_sharded(guard.model) and dist.is_initialized() and dist.get_world_size() > 1:
        return ShardMirror(dist.get_rank(), dist.get_world_size())
    return None


# ------------------------------------------------------------------ restore
def _replica_peers(guard: Guard) -> list[int]:
    """Under HSDP, the ranks holding the same shard as this one (the replicate dimension)."""
    mesh = _mesh(guard)
    if mesh is None or mesh.ndim < 2:
        return []
    group = mesh.get_group(0)  # (replicate, shard): dim 0 replicates
    return [r for r in dist.get_process_group_ranks(group) if r != dist.get_rank()]


def _mesh(guard: Guard) -> Any:
    params = guard.model.parameters()
    return next((p.device_mesh for p in params if sharding.is_dtensor(p)), None)  # type: ignore[attr-defined]


def restore_group(guard: Guard, *, fresh: bool) -> dict[str, Any]:
    """Every rank of a new generation: bring a replacement's shard back; say from where.

    A fresh rank takes a live replica peer's shard (HSDP) or its buddy's mirror;
    every rank continues from the same step. Returns `source` (`replica`,
    `buddy` or `dcp`), `step` and, per replacement, the rank it came from.
    """
    world = dist.get_world_size()
    mirror = guard.mirror
    if mirror is not None:
        mirror.wait()
    mine = {
        "fresh": fresh,
        "held": mirror.held_step() if mirror is not None else None,
        "ring": guard.snapshots.steps(),
        "boundary": guard.step_count,
        "replicas": _replica_peers(guard),
    }
    views = restore_point.gather(mine, dist.group.WORLD).values
    fresh_ranks = [r for r, v in enumerate(views) if v["fresh"]]
    survivors = [r for r in range(world) if r not in fresh_ranks]
    if not survivors:
        raise RuntimeError("every rank is fresh: nothing to restore a shard from in memory")
    lead = survivors[0]
    sources: dict[int, tuple[str, int]] = {}
    steps: set[int] = set()
    for f in fresh_ranks:
        peers = [p for p in views[f]["replicas"] if p in survivors]
        buddy = (f + 1) % world
        if peers:  # the same shard, live, at the boundary: nothing to roll back
            sources[f] = ("replica", peers[0])
            steps.add(views[peers[0]]["boundary"])
        elif buddy in survivors and views[buddy]["held"] is not None:
            sources[f] = ("buddy", buddy)
            steps.add(views[buddy]["held"])
    step = min(steps) if steps else None
    in_memory = (
        len(sources) == len(fresh_ranks)
        and len(steps) <= 1
        and all(step == views[r]["boundary"] or step in views[r]["ring"] for r in survivors)
    )
    if not in_memory:
        missing = [f for f in fresh_ranks if f not in sources]
        why = (
            f"no live replica or buddy holds the shard of rank(s) {missing}"
            if missing
            else f"the shards in memory are of different steps ({sorted(steps)})"
        )
        out = restore_point.resume(guard, step=1 << 62)
        if out.get("why"):
            why += f"; {out['why']}"
        log.warning("shards_from_dcp", rank=dist.get_rank(), step=out["step"], why=why)
        return {"source": "dcp", "step": out["step"], "why": why, "fresh": fresh_ranks,
                "steps_lost": max(max(v["boundary"] for v in views) - out["step"], 0)}  # fmt: skip
    common: list[Any] = [None]
    if dist.get_rank() == lead:  # remediations and command bookkeeping: the same on every rank
        common = [{k: v for k, v in train_state.capture(guard).items() if k != "snapshot"}]
    dist.broadcast_object_list(common, src=lead)
    reached = max(v["boundary"] for v in views)
    snap = _transfer(guard, sources, fresh_ranks, step)
    # Each rank's snapshot is its own (a survivor's, or a replacement's from its buddy's mirror).
    train_state.adopt(guard, {**common[0], "snapshot": snap}, own=True)
    kinds = {k for k, _ in sources.values()}
    return {
        "source": kinds.pop() if len(kinds) == 1 else "mixed",
        "step": step,
        "steps_lost": max(reached - (step or 0), 0),
        "from": {str(f): src for f, (_, src) in sources.items()},
        "fresh": fresh_ranks,
    }


def _transfer(
    guard: Guard, sources: dict[int, tuple[str, int]], fresh: list[int], step: int | None
) -> Snapshot:
    """Send each replacement its shard; return the snapshot this rank continues from."""
    me = dist.get_rank()
    mine: Snapshot | None = None
    if me not in fresh:
        at = guard.snapshots.newest_at_or_before(step if step is not None else guard.step_count)
        mine = at if at is not None and at.step == step else guard.take_snapshot()
    for f in fresh:
        kind, src = sources[f]
        if me == src:
            if kind == "replica":
                assert mine is not None
                payload: list[Any] = [pack(mine)]
            else:
                assert guard.mirror is not None and guard.mirror.held is not None
                _, meta, flat = guard.mirror.held
                payload = [(meta, flat)]
            dist.send_object_list(payload, dst=f)
        elif me == f:
            box: list[Any] = [None]
            dist.recv_object_list(box, src=src)
            meta, flat = box[0]
            mine = unpack(meta, flat, _mesh(guard))
    assert mine is not None
    return mine
