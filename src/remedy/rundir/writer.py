"""The run directory: the files a person or a dashboard reads after a run.

| file | one line / content |
| `decisions.jsonl` | one decision with its outcome (structlog JSON) |
| `anomalies.jsonl` | one anomaly event |
| `metrics.jsonl` | one step of one rank |
| `journal.wal` | the supervisor's state records (`RunState`), and deltas between them |
| `history.jsonl` | what the supervisor did: decisions taken and resolved, job moves, restarts |
| `summary.json` | the run's status and totals |
| `checkpoints/` | durable checkpoints |

Every line is flushed as it is written; the state records are fsynced, so a
supervisor that dies mid-decision resumes from what it had promised. The
history is what people and reports read; a restarted supervisor takes no
control state from it.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any, TextIO

import structlog

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


# Step records of ranks that report through a node agent: one file per agent
# (`remedy.supervisor.agent.actor`), read together with `metrics.jsonl`.
AGENT_METRICS_GLOB = "metrics-agent-*.jsonl"
# Step records of ranks 1.. of a group that decides without a supervisor (torchrun, Ray
# Train): each writes its own (`remedy.rank.link.group_decide`).
RANK_METRICS_GLOB = "metrics-rank-*.jsonl"
# The record types of journal.wal (`supervisor.core.run_state`): RunState, full or as a delta.
WAL_TYPES = ("state", "state_delta")


def metrics_paths(path: str | os.PathLike[str]) -> list[Path]:
    """Every file of step records in run directory `path`: `metrics.jsonl`, then the agents',
    then those of a launched group's ranks."""
    p = Path(path)
    return [
        p / "metrics.jsonl",
        *sorted(p.glob(AGENT_METRICS_GLOB)),
        *sorted(p.glob(RANK_METRICS_GLOB)),
    ]


class RunDir:
    """Append-only writers for one run's files."""

    def __init__(self, path: str | os.PathLike[str], run_id: str) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "checkpoints").mkdir(exist_ok=True)
        self.run_id = run_id
        self._files: dict[str, TextIO] = {}
        self._loggers: dict[str, Any] = {}

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def _logger(self, name: str) -> Any:
        if name not in self._loggers:
            fh = open(self.path / name, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives with the run
            self._files[name] = fh
            self._loggers[name] = _jsonl_logger(fh)
        return self._loggers[name]

    def decision(self, record: dict[str, Any]) -> None:
        """One line of `decisions.jsonl`."""
        self._logger("decisions.jsonl").msg("decision", run_id=self.run_id, **record)

    def anomaly(self, record: dict[str, Any]) -> None:
        """One anomaly: its line's `ts` is when it was written; the event's own time (when its
        rank saw it: a rank keeps training while its report travels) is `detected_at`."""
        ts = record.get("ts")
        if isinstance(ts, int | float) and not isinstance(ts, bool):
            record = {**record, "detected_at": ts}
        self._logger("anomalies.jsonl").msg("anomaly", run_id=self.run_id, **record)

    def metrics(self, record: dict[str, Any]) -> None:
        self.metrics_many([record])

    def metrics_many(self, records: list[dict[str, Any]], name: str = "metrics.jsonl") -> None:
        """Lines of `metrics.jsonl` in one write: the supervisor writes one per rank and step.

        Each line is what the structlog writer gives (the record, `event`, then
        `ts`), without its per-line processor chain and flush. `name`: another
        file of step records (a node agent's, `metrics-agent-<node>.jsonl`).
        """
        if not records:
            return
        self._logger(name)  # opens the file
        ts = datetime.datetime.now(tz=datetime.UTC).isoformat().replace("+00:00", "Z")
        encode = _ENCODER.encode
        lines = [encode({**r, "event": "metrics", "ts": ts}) for r in records]
        self._files[name].write("\n".join(lines) + "\n")

    def output(self, lines: list[dict[str, Any]]) -> None:
        """Lines the ranks printed, in `output.jsonl` (`rank`, `stream`, `line`, `ts` in
        seconds since the epoch): what `remedy logs` shows of a run that has ended."""
        if not lines:
            return
        self._logger("output.jsonl")  # opens the file
        encode = _ENCODER.encode
        self._files["output.jsonl"].write("\n".join(encode(x) for x in lines) + "\n")

    def wal(self, record: dict[str, Any]) -> None:
        """A state record (`state` or `state_delta`) of the write-ahead journal, on disk before
        this returns. The journal holds nothing else: a restarted supervisor reads only it."""
        if record.get("type") not in WAL_TYPES:
            raise ValueError(
                f"journal.wal holds state records only, not {record.get('type')!r}: "
                "write it to the history"
            )
        self._logger("journal.wal").msg("wal", run_id=self.run_id, **record)
        fh = self._files["journal.wal"]
        fh.flush()
        os.fsync(fh.fileno())

    def history(self, record: dict[str, Any]) -> None:
        """One line of `history.jsonl`: something the supervisor saw or did (flushed, not
        fsynced: what must survive a crash is in the state records)."""
        self._logger("history.jsonl").msg("history", run_id=self.run_id, **record)

    def write_summary(self, summary: dict[str, Any]) -> None:
        tmp = self.path / ".summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n")
        os.replace(tmp, self.path / "summary.json")

    def close(self) -> None:
        for fh in self._files.values():
            fh.close()
        self._files.clear()
        self._loggers.clear()


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every record of a JSON-lines file (a missing file reads as empty)."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
