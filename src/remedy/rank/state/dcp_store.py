"""Durable checkpoints of a sharded model through `torch.distributed.checkpoint` (DCP).

A sharded rank holds only its shard, so a checkpoint is one DCP directory
written by every rank together, plus a small payload per rank:

- `dcp-step-XXXXXXXX/`: the model and optimizer state as
  `get_state_dict(model, optimizer)` gives it (parameter names as keys,
  DTensors as values), written with `dcp.async_save`: the planning and a host
  copy happen at the boundary, the write on a background thread over a
  process group of its own, so it never meets the training's collectives;
- `step-XXXXXXXX.rankR.pt`: what is not sharded (step, tick, data position,
  scheduler, scaler, RNG, remediations), `torch.save`d;
- `step-XXXXXXXX.rankR.json`: the rank's manifest and commit marker, written
  once its part of the DCP write is done: the SHA-256 of the payload and of
  every DCP file the rank wrote (rank 0 also `.metadata`), the world size.

The names are those of `CheckpointStore` (and this store is one), so the
"committed on every rank" rule (`committed_steps`), retention, retiring a
timeline, the chaos faults and `restore_point.agree_on_disk` work unchanged.
Verifying a step checks the files of the ranks that wrote it, split among
the ranks that read it (old rank j is checked by new rank j mod world), so
agreeing on the intersection of good steps covers every file once.
`load` reads through `set_state_dict`: DCP reshards, so a checkpoint written
by 4 ranks loads into 2.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from remedy.rank.exceptions import CheckpointError
from remedy.rank.loop import waits
from remedy.rank.state.checkpoint_store import CheckpointStore, _atomic_write, _sha256
from remedy.rank.state.snapshots import Snapshot

if TYPE_CHECKING:
    from remedy.rank.guard import Guard

log = structlog.get_logger("remedy.dcp")


def _rest(snap: Snapshot) -> dict[str, Any]:
    """The part of a snapshot DCP does not carry: everything but the model and optimizer."""
    state = snap.to_state()
    state["model"], state["optimizer"] = {}, {}
    return state


class DcpStore(CheckpointStore):
    """Checkpoints of a sharded model's rank: one DCP directory per step, shared by the ranks."""

    def __init__(self, directory: str | Path, *, guard: Guard, keep: int = 3) -> None:
        self.world_size = dist.get_world_size()
        super().__init__(directory, rank=dist.get_rank(), keep=keep)
        self._guard = guard
        # The background write's collectives run on a group of their own (gloo: CPU only).
        self._pg = dist.new_group(backend="gloo")
        self._pending: Future[Any] | None = None

    def renew_group(self) -> None:
        """A new process-group generation: a fresh group for the writes (a collective)."""
        self._pending = None  # a write of the broken generation: its ranks never commit it
        self._pg = dist.new_group(backend="gloo")

    def _dcp_dir(self, step: int) -> Path:
        return self.directory / f"dcp-step-{step:08d}"

    def _fresh_dcp_dir(self, step: int) -> str:
        """`step`'s DCP directory, with this rank's shard files of an earlier write unlinked.

        DCP writes shard files in place: one of a checkpoint written again (the
        step reached again after a rollback) may be a hard link into the run
        this one resumed from (`remedy run --resume-from`), never to be written through.
        """
        folder = self._dcp_dir(step)
        for old in folder.glob(f"__{self.rank}_*.distcp"):
            old.unlink(missing_ok=True)
        return str(folder)

    def _live_state(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self._guard.model, self._guard.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    # ---------------------------------------------------------------- write
    def save(self, snap: Snapshot) -> Future[Path]:
        """Every rank at the same boundary: start the DCP write now, commit in the background.

        `snap` is the snapshot of this boundary; the sharded state is read live
        (the same numbers) through `get_state_dict`, which DCP needs to reshard.
        """
        # One write at a time: DCP's background collectives of two writes must not interleave.
        if self._pending is not None:
            waits.result(self._pending, waits.CHECKPOINT_S, "the previous DCP checkpoint")
        written = dcp.async_save(
            self._live_state(), checkpoint_id=self._fresh_dcp_dir(snap.step), process_group=self._pg
        )
        pending: Any = written
        self._pending = pending
        return self._pool.submit(self._commit, snap, pending)

    def save_now(self, snap: Snapshot) -> Path:
        """Write `snap` now (every rank at the same boundary); CheckpointError if it cannot."""
        try:
            dcp.save(
                self._live_state(),
                checkpoint_id=self._fresh_dcp_dir(snap.step),
                process_group=self._pg,
            )
        except (OSError, RuntimeError) as exc:
            raise CheckpointError(f"DCP checkpoint at step {snap.step} failed: {exc}") from exc
        return self._commit(snap, None)

    def _commit(self, snap: Snapshot, written: Future[Any] | None) -> Path:
        if written is not None:
            try:
                waits.result(written, waits.CHECKPOINT_S, f"the DCP checkpoint of step {snap.step}")
            except (OSError, RuntimeError) as exc:
                raise CheckpointError(f"DCP checkpoint at step {snap.step} failed: {exc}") from exc
        buf = io.BytesIO()
        torch.save(_rest(snap), buf)
        data = buf.getvalue()
        folder = self._dcp_dir(snap.step)
        mine = sorted(folder.glob(f"__{self.rank}_*.distcp"))
        if self.rank == 0:
            mine.append(folder / ".metadata")
        manifest = {
            "step": snap.step,
            "tick": snap.tick,
            "rank": self.rank,
            "world_size": self.world_size,
            "file": self._payload(snap.step).name,
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "dcp": {"dir": folder.name, "files": {p.name: _sha256(p) for p in mine}},
        }
        with self._lock:
            _atomic_write(self._payload(snap.step), data)
            # The manifest last: it is the commit marker of this rank's part.
            _atomic_write(self._manifest(snap.step), json.dumps(manifest).encode())
            self._set_known_good(snap.step)
            self._prune()
        return self._payload(snap.step)

    def _delete(self, step: int) -> None:
        """Remove this rank's share of a checkpoint (old rank j is removed by rank j mod world)."""
        for j, manifest in self._manifests(step).items():
            if j % self.world_size != self.rank:
                continue
            path = self.directory / f"step-{step:08d}.rank{j}.json"
            path.unlink(missing_ok=True)  # the commit marker first
            (self.directory / f"step-{step:08d}.rank{j}.pt").unlink(missing_ok=True)
            for name in manifest.get("dcp", {}).get("files", {}):
                (self._dcp_dir(step) / name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            if not any(self.directory.glob(f"step-{step:08d}.rank*.json")):
                shutil.rmtree(self._dcp_dir(step))

    def _manifests(self, step: int) -> dict[int, dict[str, Any]]:
        out = {}
        for path in self.directory.glob(f"step-{step:08d}.rank*.json"):
            try:
                data = json.loads(path.read_text())
                out[int(data["rank"])] = data
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return out

    # ----------------------------------------------------------------- read
    def verify(self, step: int) -> None:
        """Check this rank's share of the files of `step` (and that every writer committed)."""
        manifests = self._manifests(step)
        if self.rank not in manifests:
            raise CheckpointError(f"checkpoint at step {step} has no manifest for rank {self.rank}")
        world = int(manifests[self.rank].get("world_size", self.world_size))
        missing = [j for j in range(world) if j not in manifests]
        if missing:
            raise CheckpointError(
                f"checkpoint at step {step} was not committed by ranks {missing} of {world}"
            )
        for j in range(world):
            if j % self.world_size != self.rank:
                continue
            self._check(step, manifests[j])

    def _check(self, step: int, manifest: dict[str, Any]) -> None:
        payload = self.directory / str(manifest["file"])
        files = {payload: manifest["sha256"]}
        folder = self.directory / str(manifest["dcp"]["dir"])
        files.update({folder / n: h for n, h in manifest["dcp"]["files"].items()})
        for path, expected in files.items():
            try:
                got = _sha256(path)
            except OSError as exc:
                raise CheckpointError(f"checkpoint at step {step} is unreadable: {exc}") from exc
            if got != expected:
                raise CheckpointError(
                    f"checkpoint at step {step} failed its checksum ({path.name}: expected "
                    f"{str(expected)[:12]}, got {got[:12]})"
                )

    def load(self, step: int) -> Snapshot:
        """Every rank at once: load `step` into the live model and optimizer, resharded as needed.

        Returns the snapshot of the loaded state (local shards plus the
        rank's payload: RNG, data position, scheduler, remediations).
        """
        self.verify(step)
        manifests = self._manifests(step)
        own = self.directory / str(manifests[self.rank]["file"])
        try:
            rest = torch.load(io.BytesIO(own.read_bytes()), map_location="cpu", weights_only=False)
            state = self._live_state()
            dcp.load(state, checkpoint_id=str(self._dcp_dir(step)), process_group=self._pg)
        except (OSError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint at step {step} could not be loaded: {exc}") from exc
        set_state_dict(
            self._guard.model,
            self._guard.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        live = self._guard.take_snapshot()
        rest.update(model=live.model, optimizer=live.optimizer)
        self.mark_good(step)
        return Snapshot.from_state(rest)

    def close(self) -> None:
        if self._pending is not None:
            with contextlib.suppress(Exception):
                waits.result(self._pending, waits.CHECKPOINT_S, "the last DCP checkpoint")
        super().close()
