"""The run directory's file names: the one list, which the writer, the readers and the claim use.

| file | one line / content |
| --- | --- |
| `decisions.jsonl` | one decision with its outcome (structlog JSON) |
| `anomalies.jsonl` | one anomaly event |
| `metrics.jsonl` | one step of one rank (and `metrics-agent-*.jsonl`, `metrics-rank-*.jsonl`) |
| `journal.wal` | the supervisor's state records (`RunRecord`), and deltas between them |
| `history.jsonl` | what the supervisor did: decisions taken and resolved, job moves, restarts |
| `output.jsonl` | the lines the ranks printed |
| `notifications.jsonl` | one notification and whether it was delivered |
| `summary.json` | the run's status and totals |
| `.remedy-run` | the claim: the run id, then one line per supervisor that started |
| `checkpoints/` | durable checkpoints |
| `logs/` | a failed run's Ray logs, with `index.json` |

The user-facing names are ARCHITECTURE.md's run-directory contract.
"""

from __future__ import annotations

MARKER = ".remedy-run"
SUMMARY = "summary.json"
DECISIONS = "decisions.jsonl"
ANOMALIES = "anomalies.jsonl"
METRICS = "metrics.jsonl"
JOURNAL = "journal.wal"
HISTORY = "history.jsonl"
OUTPUT = "output.jsonl"
NOTIFICATIONS = "notifications.jsonl"
CHECKPOINTS = "checkpoints"
LOGS = "logs"
# Step records of ranks that report through a node agent: one file per agent
# (`remedy.supervisor.agent.actor`), read together with `metrics.jsonl`.
AGENT_METRICS_GLOB = "metrics-agent-*.jsonl"
# Step records of ranks 1.. of a group that decides without a supervisor (torchrun, Ray
# Train): each writes its own (`remedy.rank.link.group_decide`).
RANK_METRICS_GLOB = "metrics-rank-*.jsonl"

# A directory holding one of these holds a run: `remedy run` will not claim it (a second run
# there would mix journals), and without `summary.json` it is a run in progress or cut short.
RUN_FILES = (MARKER, SUMMARY, JOURNAL, HISTORY, DECISIONS, ANOMALIES, METRICS)
