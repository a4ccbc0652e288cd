"""Durable checkpoints on disk: atomic, checksummed, retained, retired with their timeline.

Each checkpoint is one `torch.save` payload per rank plus a small JSON
manifest holding its SHA-256; the manifest is the rank's commit marker for
that step. Both are written to a temporary name, fsynced, renamed, and the
directory fsynced, so a crash mid-write leaves the previous checkpoint
intact and a completed one survives a power cut. A write that fails with an
`OSError` (a full or flaky disk) is retried with tenacity within bounds,
then raised as `CheckpointError`; each write is read back and verified.

Retention keeps the newest `keep` checkpoints plus the last known-good one
(the newest verified by a successful restore or read-back), which is never
pruned. A rollback retires the checkpoints newer than the step it restored
(`retire_after`), so a later resume never lands on the abandoned timeline.
`committed_steps` is the supervisor's view: the steps every rank committed.
Writes run on a background thread from a host copy (the snapshot), so
training does not wait on the disk.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch
import torch.distributed as dist
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from remedy.rank.exceptions import CheckpointError
from remedy.rank.loop import waits
from remedy.rank.state.sharding import is_sharded
from remedy.rank.state.snapshots import Snapshot

if TYPE_CHECKING:
    from remedy.rank.guard import Guard

log = structlog.get_logger("remedy.checkpoint")

# Bounds on retrying a write that failed with an OSError; then CheckpointError.
WRITE_ATTEMPTS = 4
WRITE_WAIT_S = (0.05, 1.0)
KNOWN_GOOD = "known-good.rank{rank}.json"


def fsync_dir(directory: Path) -> None:
    """Make the directory entries of files renamed into `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def _sha256(path: Path) -> str:
    """The file's SHA-256, read in chunks (no second copy of a large payload in memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _step_of(name: str) -> int | None:
    try:
        return int(name.split(".")[0].removeprefix("step-"))
    except ValueError:
        return None


class CheckpointStore:
    """Checkpoints of one rank under `directory`: the newest `keep` plus the last known-good."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        rank: int = 0,
        keep: int = 3,
        verify_writes: bool = True,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.keep = max(keep, 1)
        self.verify_writes = verify_writes
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="remedy-ckpt")
        self._lock = threading.Lock()
        self.on_corrupt: Callable[[int, str], None] | None = None
        self._closed = False
        self.known_good = self._read_known_good()

    def _payload(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}.rank{self.rank}.pt"

    def _manifest(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}.rank{self.rank}.json"

    # ---------------------------------------------------------------- write
    def save(self, snap: Snapshot) -> Future[Path]:
        """Write `snap` in the background; the future resolves to the payload path."""
        return self._pool.submit(self.save_now, snap)

    def save_now(self, snap: Snapshot) -> Path:
        """Write `snap` now, retrying transient I/O errors; raise CheckpointError if it cannot."""
        buf = io.BytesIO()
        torch.save(snap.to_state(), buf)
        data = buf.getvalue()
        payload = self._payload(snap.step)
        manifest = {
            "step": snap.step,
            "tick": snap.tick,
            "rank": self.rank,
            "file": payload.name,
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        attempts = 0
        with self._lock:
            try:
                for attempt in Retrying(
                    stop=stop_after_attempt(WRITE_ATTEMPTS),
                    wait=wait_exponential(min=WRITE_WAIT_S[0], max=WRITE_WAIT_S[1]),
                    retry=retry_if_exception_type(OSError),
                    reraise=True,
                ):
                    with attempt:
                        attempts = attempt.retry_state.attempt_number
                        self._write(payload, data, manifest)
            except OSError as exc:
                raise CheckpointError(
                    f"checkpoint at step {snap.step} could not be written after {attempts} "
                    f"attempts: {exc}"
                ) from exc
            if self.verify_writes:
                self._set_known_good(snap.step)
            self._prune()
        return payload

    def _write(self, payload: Path, data: bytes, manifest: dict[str, Any]) -> None:
        _atomic_write(payload, data)
        if self.verify_writes and _sha256(payload) != manifest["sha256"]:
            # Read back wrong: as transient as a failed write, and retried like one.
            raise OSError(f"{payload.name} read back different from what was written")
        # The manifest last: it is the commit marker of this rank's checkpoint.
        _atomic_write(self._manifest(manifest["step"]), json.dumps(manifest).encode())

    def _prune(self) -> None:
        for step in self.steps()[: -self.keep]:
            if step != self.known_good:
                self._delete(step)

    def _delete(self, step: int) -> None:
        # The manifest first: a half-deleted checkpoint is then not listed at all.
        self._manifest(step).unlink(missing_ok=True)
        self._payload(step).unlink(missing_ok=True)

    # ------------------------------------------------------- known-good, retire
    def _read_known_good(self) -> int | None:
        try:
            step = json.loads((self.directory / KNOWN_GOOD.format(rank=self.rank)).read_text())[
                "step"
            ]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return step if type(step) is int else None

    def _set_known_good(self, step: int | None) -> None:
        if step == self.known_good:
            return
        self.known_good = step
        path = self.directory / KNOWN_GOOD.format(rank=self.rank)
        if step is None:
            path.unlink(missing_ok=True)
        else:
            _atomic_write(path, json.dumps({"step": step}).encode())

    def mark_good(self, step: int) -> None:
        """`step` was verified (restored, or read back): keep it whatever retention says."""
        with self._lock:
            self._set_known_good(step)

    def retire_after(self, step: int) -> list[int]:
        """Delete the checkpoints newer than `step` (a rollback abandoned their timeline).

        Returns the retired steps. Writes still queued are finished first, so
        none of the abandoned timeline lands after this returns.
        """
        self.wait()
        with self._lock:
            retired = [s for s in self.steps() if s > step]
            for s in retired:
                self._delete(s)
            if self.known_good is not None and self.known_good > step:
                self._set_known_good(None)
        if retired:
            log.info("checkpoints_retired", rank=self.rank, after=step, steps=retired)
        return retired

    def steps(self) -> list[int]:
        """Steps that have a manifest, oldest first."""
        out = []
        for p in self.directory.glob(f"step-*.rank{self.rank}.json"):
            step = _step_of(p.name)
            if step is not None:
                out.append(step)
        return sorted(out)

    def wait(self) -> None:
        """Block until queued writes are on disk (`WaitTimeout` past `waits.CHECKPOINT_S`)."""
        if not self._closed:
            waits.result(
                self._pool.submit(lambda: None), waits.CHECKPOINT_S, "the checkpoint writes"
            )

    # ----------------------------------------------------------------- read
    def _read(self, step: int) -> bytes:
        try:
            manifest: dict[str, Any] = json.loads(self._manifest(step).read_text())
            data = (self.directory / manifest["file"]).read_bytes()
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"checkpoint at step {step} is unreadable: {exc}") from exc
        digest = hashlib.sha256(data).hexdigest()
        if digest != manifest.get("sha256") or len(data) != manifest.get("bytes"):
            raise CheckpointError(
                f"checkpoint at step {step} failed its checksum "
                f"(expected {str(manifest.get('sha256', '?'))[:12]}, got {digest[:12]})"
            )
        return data

    def verify(self, step: int) -> None:
        """Check the checkpoint at `step` against its checksum; CheckpointError if it is bad."""
        self._read(step)

    def verified_steps(self, *, at_or_before: int | None = None) -> list[int]:
        """Steps (oldest first) whose checkpoint passes its checksum; `on_corrupt` hears of the rest."""
        self.wait()
        good = []
        for step in self.steps():
            if at_or_before is not None and step > at_or_before:
                continue
            try:
                self.verify(step)
            except CheckpointError as exc:
                self._corrupt(step, exc)
                continue
            good.append(step)
        return good

    def _corrupt(self, step: int, exc: CheckpointError) -> None:
        log.warning("checkpoint_corrupt", step=step, rank=self.rank, error=str(exc))
        if self.on_corrupt is not None:
            self.on_corrupt(step, str(exc))

    def load(self, step: int) -> Snapshot:
        """Load and verify the checkpoint at `step`; raise CheckpointError if it is bad."""
        data = self._read(step)
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        snap = Snapshot.from_state(state)
        self.mark_good(step)
        return snap

    def load_latest(self, *, at_or_before: int | None = None) -> Snapshot:
        """The newest verified checkpoint (at or before a step); corrupt ones are skipped."""
        self.wait()
        candidates = [s for s in self.steps() if at_or_before is None or s <= at_or_before]
        errors = []
        for step in reversed(candidates):
            try:
                return self.load(step)
            except CheckpointError as exc:
                errors.append(str(exc))
                self._corrupt(step, exc)
        bound = "" if at_or_before is None else f" at or before step {at_or_before}"
        detail = "; ".join(errors) if errors else "none written yet"
        raise CheckpointError(f"no usable checkpoint{bound} in {self.directory}: {detail}")

    def close(self) -> None:
        """Finish queued writes; the store can still be read afterwards."""
        self._closed = True
        waits.drain(self._pool, waits.CHECKPOINT_S, "the checkpoint writes")


def committed_steps(directory: str | os.PathLike[str], world_size: int) -> list[int]:
    """Steps (oldest first) for which every rank holds a committed checkpoint; a pure file check.

    A rank's checkpoint counts when its manifest parses and names a payload
    of the recorded size. Retired checkpoints have no manifest, so a step of
    an abandoned timeline is never among them. The ranks verify checksums
    when they load, and agree on an older step if one fails.
    """
    root = Path(directory)
    common: set[int] | None = None
    for rank in range(world_size):
        steps = set()
        for path in root.glob(f"step-*.rank{rank}.json"):
            step = _step_of(path.name)
            if step is not None and _committed(root, path, step, rank):
                steps.add(step)
        common = steps if common is None else common & steps
        if not common:
            return []
    return sorted(common or ())


def committed_manifests(directory: str | os.PathLike[str], step: int) -> dict[int, dict[str, Any]]:
    """The manifests of the ranks that committed `step`, by rank; a pure file check."""
    root = Path(directory)
    out: dict[int, dict[str, Any]] = {}
    for path in root.glob(f"step-{step:08d}.rank*.json"):
        try:
            rank = int(path.name.split(".rank")[1].removesuffix(".json"))
        except (IndexError, ValueError):
            continue
        if _committed(root, path, step, rank):
            with contextlib.suppress(OSError, ValueError):  # retired meanwhile
                out[rank] = json.loads(path.read_text())
    return out


def _committed(root: Path, manifest: Path, step: int, rank: int) -> bool:
    try:
        data = json.loads(manifest.read_text())
        payload = root / str(data["file"])
        return (
            data.get("step") == step
            and data.get("rank") == rank
            and payload.parent == root
            and payload.stat().st_size == data["bytes"]
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # not a manifest's JSON
        return False


def checkpoint_tick(directory: str | os.PathLike[str], step: int, rank: int = 0) -> int | None:
    """The tick recorded in `rank`'s manifest of `step` (None if unknown)."""
    path = Path(directory) / f"step-{step:08d}.rank{rank}.json"
    try:
        tick = json.loads(path.read_text()).get("tick")
    except (OSError, ValueError, AttributeError):
        return None
    return tick if type(tick) is int else None


def store_for(guard: Guard, directory: Path, *, keep: int) -> CheckpointStore:
    """The checkpoint store a Guard uses: DCP for a sharded model in a process group.

    DCP (`workers.dcp_store`) is imported only then: it pulls in DTensor and
    torch's checkpoint package, most of a second for every process that imports remedy."""
    if is_sharded(guard.model) and dist.is_initialized() and dist.get_world_size() > 1:
        from remedy.rank.state.dcp_store import DcpStore  # noqa: PLC0415 - sharded jobs only

        return DcpStore(directory, guard=guard, keep=keep)
    return CheckpointStore(directory, rank=guard.rank, keep=keep)
