"""Durable checkpoints on disk: atomic, checksummed, with fallback.

Each checkpoint is one `torch.save` payload per rank plus a small JSON
manifest holding its SHA-256. Both are written to a temporary name, fsynced
and renamed, so a crash mid-write leaves the previous checkpoint intact. A
load verifies the checksum; a corrupt or unreadable checkpoint is reported
and the previous one is tried. Writes run on a background thread from a
host copy (the snapshot), so training does not wait on the disk.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import structlog
import torch

from remedy.workers.exceptions import CheckpointError
from remedy.workers.snapshots import Snapshot

log = structlog.get_logger("remedy.checkpoint")


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class CheckpointStore:
    """Checkpoints of one rank under `directory`, newest `keep` kept."""

    def __init__(self, directory: str | os.PathLike[str], *, rank: int = 0, keep: int = 3) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.keep = keep
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="remedy-ckpt")
        self._lock = threading.Lock()
        self.on_corrupt: Callable[[int, str], None] | None = None

    def _payload(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}.rank{self.rank}.pt"

    def _manifest(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}.rank{self.rank}.json"

    def save(self, snap: Snapshot) -> Future[Path]:
        """Write `snap` in the background; the future resolves to the payload path."""
        return self._pool.submit(self.save_now, snap)

    def save_now(self, snap: Snapshot) -> Path:
        buf = io.BytesIO()
        torch.save(snap.to_state(), buf)
        data = buf.getvalue()
        payload = self._payload(snap.step)
        with self._lock:
            _atomic_write(payload, data)
            manifest = {
                "step": snap.step,
                "rank": self.rank,
                "file": payload.name,
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
            _atomic_write(self._manifest(snap.step), json.dumps(manifest).encode())
            self._prune()
        return payload

    def _prune(self) -> None:
        for step in self.steps()[: -self.keep]:
            self._payload(step).unlink(missing_ok=True)
            self._manifest(step).unlink(missing_ok=True)

    def steps(self) -> list[int]:
        """Steps that have a manifest, oldest first."""
        out = []
        for p in self.directory.glob(f"step-*.rank{self.rank}.json"):
            try:
                out.append(int(p.name.split(".")[0].removeprefix("step-")))
            except ValueError:
                continue
        return sorted(out)

    def wait(self) -> None:
        """Block until queued writes are on disk."""
        self._pool.submit(lambda: None).result()

    def load(self, step: int) -> Snapshot:
        """Load and verify the checkpoint at `step`; raise CheckpointError if it is bad."""
        try:
            manifest: dict[str, Any] = json.loads(self._manifest(step).read_text())
            data = (self.directory / manifest["file"]).read_bytes()
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"checkpoint at step {step} is unreadable: {exc}") from exc
        digest = hashlib.sha256(data).hexdigest()
        if digest != manifest.get("sha256") or len(data) != manifest.get("bytes"):
            raise CheckpointError(
                f"checkpoint at step {step} failed its checksum "
                f"(expected {manifest.get('sha256', '?')[:12]}, got {digest[:12]})"
            )
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        return Snapshot.from_state(state)

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
                log.warning("checkpoint_corrupt", step=step, rank=self.rank, error=str(exc))
                if self.on_corrupt is not None:
                    self.on_corrupt(step, str(exc))
        bound = "" if at_or_before is None else f" at or before step {at_or_before}"
        detail = "; ".join(errors) if errors else "none written yet"
        raise CheckpointError(f"no usable checkpoint{bound} in {self.directory}: {detail}")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
