"""Reaching a run from any shell: its registry entry, its Ray cluster, its supervisor.

`remedy status`, `logs`, `stop`, `attach` and `policy apply` name a run by
id. The registry entry (`remedy.cli.registry`) says where it runs and
holds the token its supervisor asks for; a run that has ended is read from
its run directory's `summary.json` instead. Every way this can go wrong (an
unknown id, a run on another cluster than `--address` names, a cluster that
no longer answers) is an `AccessError` with one line to print.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from remedy.cli import registry
from remedy.cli.cluster import Choice, ClusterError, choose, connect, disconnect
from remedy.protocol.exceptions import SupervisorError, Unauthorized
from remedy.protocol.spec import NAMESPACE, supervisor_name

EXIT_FAILED, EXIT_USAGE = 1, 2


class AccessError(SupervisorError):
    """A run cannot be reached; `exit_code` is 2 for bad input, 1 for a run or cluster gone."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def __reduce__(self) -> Any:
        return (type(self), (str(self), self.exit_code))


@dataclass(frozen=True)
class RunRef:
    """A run found in the registry."""

    run_id: str
    entry: dict[str, Any]

    @property
    def token(self) -> str:
        return str(self.entry.get("token") or "")

    @property
    def address(self) -> str:
        return str(self.entry.get("address") or "")

    @property
    def run_dir(self) -> Path | None:
        value = self.entry.get("run_dir")
        return Path(value) if isinstance(value, str) and value else None

    def summary(self) -> dict[str, Any] | None:
        """The run's summary.json if the run has ended and its directory is readable here."""
        if self.run_dir is None:
            return None
        try:
            data = json.loads((self.run_dir / "summary.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None


def find(run_id: str, address: str | None = None) -> RunRef:
    """The registry entry of `run_id`; AccessError if there is none, or it runs elsewhere."""
    if not registry.valid_run_id(run_id):
        raise AccessError(f"{run_id!r} is not a run id", EXIT_USAGE)
    entry = registry.lookup(run_id)
    if entry is None:
        raise AccessError(
            f"unknown run {run_id!r}: not in this machine's registry ({registry.registry_dir()}); "
            "`remedy status` lists the runs started here",
            EXIT_USAGE,
        )
    ref = RunRef(run_id, entry)
    if address is not None:
        try:
            wanted = choose(address)
        except ClusterError as exc:
            raise AccessError(str(exc), EXIT_USAGE) from None
        if wanted.mode == "cluster" and wanted.address != ref.address:
            raise AccessError(
                f"run {run_id} is on the Ray cluster at {ref.address or 'a private Ray'}, "
                f"not {wanted.address}",
                EXIT_USAGE,
            )
    return ref


@contextlib.contextmanager
def joined(
    address: str, *, ray_token: str | None = None, what: str = "", exit_code: int = EXIT_FAILED
) -> Iterator[None]:
    """Connected to the Ray at `address` (or this process's own connection) for the block.

    The environment (Ray's auth settings) is restored afterwards, so one
    command can visit several clusters in turn.
    """
    saved = dict(os.environ)
    try:
        try:
            conn = connect(Choice("cluster", address, "registry"), token=ray_token)
        except ClusterError as exc:
            prefix = f"{what}: " if what else ""
            raise AccessError(f"{prefix}{exc}", exit_code) from None
        try:
            yield
        finally:
            disconnect(conn)
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def supervisor_of(ref: RunRef) -> Iterator[Any | None]:
    """The run's supervisor actor, or None when it has none (it ended, or was lost)."""
    import ray  # noqa: PLC0415 - the CLI imports Ray only when it needs it

    with joined(
        ref.address, ray_token=ref.entry.get("ray_token"), what=f"run {ref.run_id}'s Ray cluster"
    ):
        try:
            handle = ray.get_actor(supervisor_name(ref.run_id), namespace=NAMESPACE)
        except ValueError:
            handle = None
        yield handle


@contextlib.contextmanager
def live_supervisor(ref: RunRef) -> Iterator[Any]:
    """The supervisor of a run still going; AccessError saying how it ended (or that it was lost)."""
    ended = ref.summary()
    if ended is None:
        with supervisor_of(ref) as sup:
            if sup is not None:
                yield sup
                return
        ended = ref.summary()  # it may have ended just now
    if ended is None:
        raise gone(ref)
    raise AccessError(f"run {ref.run_id} has ended already ({ended.get('status')})")


def gone(ref: RunRef) -> AccessError:
    """The error for a run with neither a supervisor nor a summary."""
    return AccessError(
        f"run {ref.run_id} has no supervisor on the Ray cluster at {ref.address} and no "
        f"summary.json in {ref.run_dir}: it was lost (its cluster stopped, or it was killed)"
    )


def call_failed(exc: BaseException, run_id: str, what: str) -> AccessError:
    """One line for a failed call to run `run_id`'s supervisor ("did not answer", say)."""
    if isinstance(getattr(exc, "cause", None), Unauthorized):
        return AccessError(
            f"run {run_id} refused the call: the token in its registry entry is not the run's "
            "(Unauthorized)"
        )
    text = " ".join(str(exc).split())[:200]
    return AccessError(f"run {run_id}'s supervisor {what} ({type(exc).__name__}: {text})")
