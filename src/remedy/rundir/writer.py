"""The run directory's writer: the files a person or a dashboard reads after a run
(`rundir.names` lists them).

Every line is flushed as it is written; the state records are fsynced, so a
supervisor that dies mid-decision resumes from what it had promised. The
history is what people and reports read; a restarted supervisor takes no
control state from it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
from pathlib import Path
from typing import Any, TextIO

import structlog

from remedy.rundir import names

# The reader of what this writes, where its callers have long imported it from.
from remedy.rundir.jsonl import read_jsonl as read_jsonl
from remedy.rundir.write_errors import RunDirWriteError, fallback_dir, gone

# As structlog's JSONRenderer(default=str) encodes, built once instead of per line.
_ENCODER = json.JSONEncoder(default=str)


def _jsonl_logger(fh: TextIO) -> Any:
    return structlog.wrap_logger(
        structlog.WriteLogger(fh),
        processors=[
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
            structlog.processors.JSONRenderer(sort_keys=False, default=str),
        ],
        # Journals must never be filtered by the process's log level.
        wrapper_class=structlog.BoundLogger,
        cache_logger_on_first_use=True,
    )


# The record types of journal.wal (`control.record`): RunRecord, full or as a delta.
WAL_TYPES = ("state", "state_delta")


def metrics_paths(path: str | os.PathLike[str]) -> list[Path]:
    """Every file of step records in run directory `path`: `metrics.jsonl`, then the agents',
    then those of a launched group's ranks."""
    p = Path(path)
    return [
        p / names.METRICS,
        *sorted(p.glob(names.AGENT_METRICS_GLOB)),
        *sorted(p.glob(names.RANK_METRICS_GLOB)),
    ]


class RunDir:
    """Append-only writers for one run's files.

    The first write that fails (a full disk, a read-only or deleted directory)
    raises `RunDirWriteError` naming the file and the cause, and is kept in
    `broken`: after it the state records (`wal`) raise it again, since no reply
    may carry a promise the journal lacks, and the other files' lines are
    dropped (`dropped` counts them), so a run that ends because of it can still
    finish and write its summary elsewhere.
    """

    def __init__(self, path: str | os.PathLike[str], run_id: str) -> None:
        self.path = Path(path)
        self.run_id = run_id
        self._files: dict[str, TextIO] = {}
        self._loggers: dict[str, Any] = {}
        self.broken: RunDirWriteError | None = None
        self.dropped = 0  # lines not written once `broken`
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / names.CHECKPOINTS).mkdir(exist_ok=True)
        except OSError as exc:  # no run here at all: the caller's to say
            raise RunDirWriteError(self.path, exc) from None

    def _failed(self, name: str, exc: OSError) -> None:
        """Keep the first write error (raised); later writes to other files are dropped."""
        error = (
            exc if isinstance(exc, RunDirWriteError) else RunDirWriteError(self.path / name, exc)
        )
        if self.broken is None:
            self.broken = error
        raise error from None

    def _write(self, name: str, write: Any) -> None:
        """Run one write of file `name`: dropped once broken, its OSError kept and raised."""
        if self.broken is not None:
            self.dropped += 1
            return
        try:
            write()
        except OSError as exc:
            self._failed(name, exc)

    def check(self) -> None:
        """Raise the write error that broke this directory, or one if it was deleted."""
        if self.broken is None:
            self.broken = gone(self.path)
        if self.broken is not None:
            raise self.broken

    @property
    def checkpoints(self) -> Path:
        return self.path / names.CHECKPOINTS

    def _logger(self, name: str) -> Any:
        if name not in self._loggers:
            fh = open(self.path / name, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives with the run
            self._files[name] = fh
            self._loggers[name] = _jsonl_logger(fh)
        return self._loggers[name]

    def decision(self, record: dict[str, Any]) -> None:
        """One line of `decisions.jsonl`."""
        self._write(names.DECISIONS, lambda: self._logger(names.DECISIONS).msg(
            "decision", run_id=self.run_id, **record))  # fmt: skip

    def anomaly(self, record: dict[str, Any]) -> None:
        """One anomaly: its line's `ts` is when it was written; the event's own time (when its
        rank saw it: a rank keeps training while its report travels) is `detected_at`."""
        ts = record.get("ts")
        if isinstance(ts, int | float) and not isinstance(ts, bool):
            record = {**record, "detected_at": ts}
        self._write(names.ANOMALIES, lambda: self._logger(names.ANOMALIES).msg(
            "anomaly", run_id=self.run_id, **record))  # fmt: skip

    def metrics(self, record: dict[str, Any]) -> None:
        self.metrics_many([record])

    def metrics_many(self, records: list[dict[str, Any]], name: str = names.METRICS) -> None:
        """Lines of `metrics.jsonl` in one write: the supervisor writes one per rank and step.

        Each line is what the structlog writer gives (the record, `event`, then
        `ts`), without its per-line processor chain and flush. `name`: another
        file of step records (a node agent's, `metrics-agent-<node>.jsonl`).
        """
        if not records:
            return
        ts = datetime.datetime.now(tz=datetime.UTC).isoformat().replace("+00:00", "Z")
        encode = _ENCODER.encode
        lines = [encode({**r, "event": "metrics", "ts": ts}) for r in records]
        self._write(name, lambda: self._append(name, "\n".join(lines) + "\n"))

    def _append(self, name: str, text: str) -> None:
        self._logger(name)  # opens the file
        self._files[name].write(text)

    def output(self, lines: list[dict[str, Any]]) -> None:
        """Lines the ranks printed, in `output.jsonl` (`rank`, `stream`, `line`, `ts` in
        seconds since the epoch): what `remedy logs` shows of a run that has ended."""
        if not lines:
            return
        encode = _ENCODER.encode
        text = "\n".join(encode(x) for x in lines) + "\n"
        self._write(names.OUTPUT, lambda: self._append(names.OUTPUT, text))

    def wal(self, record: dict[str, Any]) -> None:
        """A state record (`state` or `state_delta`) of the write-ahead journal, on disk before
        this returns. The journal holds nothing else: a restarted supervisor reads only it."""
        if record.get("type") not in WAL_TYPES:
            raise ValueError(
                f"journal.wal holds state records only, not {record.get('type')!r}: "
                "write it to the history"
            )
        if self.broken is not None:
            raise self.broken
        try:
            self._logger(names.JOURNAL).msg("wal", run_id=self.run_id, **record)
            fh = self._files[names.JOURNAL]
            fh.flush()
            os.fsync(fh.fileno())
        except OSError as exc:
            self._failed(names.JOURNAL, exc)

    def history(self, record: dict[str, Any]) -> None:
        """One line of `history.jsonl`: something the supervisor saw or did (flushed, not
        fsynced: what must survive a crash is in the state records)."""
        self._write(names.HISTORY, lambda: self._logger(names.HISTORY).msg(
            "history", run_id=self.run_id, **record))  # fmt: skip

    def write_summary(self, summary: dict[str, Any]) -> Path:
        """summary.json, written whole; where the run directory cannot take it (`broken`, or
        this write fails), in `fallback_dir`. Returns where it went."""
        text = json.dumps(summary, indent=2, default=str) + "\n"
        if self.broken is None:
            try:
                tmp = self.path / ".summary.json.tmp"
                tmp.write_text(text)
                os.replace(tmp, self.path / names.SUMMARY)
                return self.path / names.SUMMARY
            except OSError as exc:
                with contextlib.suppress(RunDirWriteError):
                    self._failed(names.SUMMARY, exc)
                with contextlib.suppress(OSError):
                    tmp.unlink()  # a partial one takes space a full disk lacks
        out = fallback_dir(self.run_id)
        out.mkdir(parents=True, exist_ok=True)
        (out / names.SUMMARY).write_text(text)
        return out / names.SUMMARY

    def close(self) -> None:
        for fh in self._files.values():
            with contextlib.suppress(OSError):  # a full disk: the buffered tail is lost
                fh.close()
        self._files.clear()
        self._loggers.clear()
