"""Counters and gauges for dashboards, named by Prometheus conventions.

| metric | type | labels |
| --- | --- | --- |
| `remedy_anomalies_total` | counter | `run_id`, `kind` |
| `remedy_decisions_total` | counter | `run_id`, `action`, `outcome` |
| `remedy_rank_restarts_total` | counter | `run_id` |
| `remedy_step_time_seconds` | gauge (newest step, set at most once a second per rank) | `run_id`, `rank` |
| `remedy_goodput_ratio` | gauge (steps kept / executed; a rollback's or restart's replays count) | `run_id` |
| `remedy_ettr_ratio` | gauge (seconds of the kept steps / wall seconds so far) | `run_id` |
| `remedy_time_lost_seconds` | gauge (seconds lost so far to each cause: an anomaly kind) | `run_id`, `cause` |
| `remedy_seconds_since_good_checkpoint` | gauge | `run_id` |

Under a supervisor they go through Ray's metrics API (`ray.util.metrics`),
which Ray's per-node exporter serves to Prometheus with the rest of Ray's
metrics, prefixed `ray_` as Ray names application metrics
(`ray_remedy_anomalies_total`). A standalone run (no supervisor) serves them itself on
`http://127.0.0.1:PORT/metrics` (`prometheus-client`) when the environment
variable `REMEDY_METRICS_PORT` is set.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Protocol

# Set to a port to serve /metrics from a standalone Guard's process.
METRICS_PORT_ENV = "REMEDY_METRICS_PORT"
CHECKPOINT_POLL_S = 1.0
# A rank's step-time gauge is set at most this often (Ray exports gauges every
# `metrics_report_interval_ms`, never more often than once a second).
STEP_TIME_EVERY_S = 1.0
GOODPUT_EVERY_S = 1.0  # the goodput gauges likewise

_SPECS: list[tuple[str, str, str, tuple[str, ...]]] = [
    ("remedy_anomalies_total", "counter", "Anomaly events reported, by kind", ("run_id", "kind")),
    (
        "remedy_decisions_total",
        "counter",
        "Policy decisions journaled, by action and outcome",
        ("run_id", "action", "outcome"),
    ),
    ("remedy_rank_restarts_total", "counter", "Ranks restarted by the supervisor", ("run_id",)),
    (
        "remedy_step_time_seconds",
        "gauge",
        "Wall time of the newest training step",
        ("run_id", "rank"),
    ),
    (
        "remedy_goodput_ratio",
        "gauge",
        "Steps kept / steps executed (rollbacks and restarts from a checkpoint redo steps)",
        ("run_id",),
    ),
    (
        "remedy_ettr_ratio",
        "gauge",
        "Effective training time ratio: seconds of the kept steps / wall seconds",
        ("run_id",),
    ),
    (
        "remedy_time_lost_seconds",
        "gauge",
        "Seconds lost to each cause (discarded steps, skipped updates, stalls)",
        ("run_id", "cause"),
    ),
    (
        "remedy_seconds_since_good_checkpoint",
        "gauge",
        "Seconds since the newest durable checkpoint with a manifest was written",
        ("run_id",),
    ),
]


class Backend(Protocol):
    def inc(self, name: str, labels: dict[str, str], value: float = 1.0) -> None: ...

    def set(self, name: str, labels: dict[str, str], value: float) -> None: ...


class RayBackend:
    """`ray.util.metrics`: exported by the Ray node the calling process runs on."""

    def __init__(self) -> None:
        from ray.util import metrics  # noqa: PLC0415 - only where Ray runs

        self._m: dict[str, Any] = {}
        for name, kind, doc, keys in _SPECS:
            cls = metrics.Counter if kind == "counter" else metrics.Gauge
            # Ray's Prometheus exporter adds the `_total` suffix to counters itself.
            export = name.removesuffix("_total") if kind == "counter" else name
            self._m[name] = cls(export, description=doc, tag_keys=keys)

    def inc(self, name: str, labels: dict[str, str], value: float = 1.0) -> None:
        self._m[name].inc(value, tags=labels)

    def set(self, name: str, labels: dict[str, str], value: float) -> None:
        self._m[name].set(value, tags=labels)


class PrometheusBackend:
    """`prometheus-client` with its own registry, served by `serve(port)`."""

    def __init__(self) -> None:
        import prometheus_client as prom  # noqa: PLC0415 - optional at import time

        self.registry = prom.CollectorRegistry()
        self._m: dict[str, Any] = {}
        for name, kind, doc, keys in _SPECS:
            if kind == "counter":
                self._m[name] = prom.Counter(
                    name.removesuffix("_total"), doc, keys, registry=self.registry
                )
            else:
                self._m[name] = prom.Gauge(name, doc, keys, registry=self.registry)
        self.server: Any = None

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics; returns the bound port (0 picks a free one)."""
        import prometheus_client as prom  # noqa: PLC0415

        self.server, _thread = prom.start_http_server(port, addr=addr, registry=self.registry)
        return int(self.server.server_port)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def inc(self, name: str, labels: dict[str, str], value: float = 1.0) -> None:
        self._m[name].labels(**labels).inc(value)

    def set(self, name: str, labels: dict[str, str], value: float) -> None:
        self._m[name].labels(**labels).set(value)


class RunMetrics:
    """Turns report batches and journaled decisions into the metrics above."""

    def __init__(self, backend: Backend, *, run_id: str, checkpoints: Path | None = None) -> None:
        self.backend = backend
        self.run_id = run_id
        self.checkpoints = checkpoints
        self._decisions_seen = 0
        self._checked = 0.0
        self._newest = 0.0  # mtime of the newest checkpoint manifest seen
        self._dir_mtime = 0  # of the checkpoint folder, while it holds no manifest yet
        self._step_time_set: dict[str, float] = {}  # rank -> when its gauge was last set
        self._goodput_set = -GOODPUT_EVERY_S

    def observe(self, batch: Any) -> None:
        """One report batch: its anomalies, its newest step time, the rank's goodput."""
        if not isinstance(batch, dict):
            return
        run = {"run_id": self.run_id}
        for ev in batch.get("events") or []:
            if isinstance(ev, dict) and isinstance(ev.get("kind"), str):
                self.backend.inc("remedy_anomalies_total", {**run, "kind": ev["kind"]})
        metrics = [m for m in batch.get("metrics") or [] if isinstance(m, dict)]
        if metrics and isinstance(metrics[-1].get("step_time_s"), int | float):
            # One set costs ~30 us in Ray and every rank reports twice a second or more;
            # Ray exports gauges at most once a second, so each rank's is set as often.
            rank = str(batch.get("rank"))
            now = time.monotonic()
            if now - self._step_time_set.get(rank, -STEP_TIME_EVERY_S) >= STEP_TIME_EVERY_S:
                self._step_time_set[rank] = now
                labels = {**run, "rank": rank}
                step_time = float(metrics[-1]["step_time_s"])
                self.backend.set("remedy_step_time_seconds", labels, step_time)
        self._checkpoint_age()

    def goodput(self, ledger: Any, started: float, *, force: bool = False) -> None:
        """The goodput gauges from the controller's ledger (`GoodputLedger`), once a second
        (`force`: now, as a run ends)."""
        now = time.monotonic()
        if (now - self._goodput_set < GOODPUT_EVERY_S and not force) or not ledger.executed:
            return
        self._goodput_set = now
        run = {"run_id": self.run_id}
        self.backend.set("remedy_goodput_ratio", run, ledger.step_goodput())
        self.backend.set("remedy_ettr_ratio", run, ledger.ettr(started, time.time()))
        for cause, seconds in ledger.lost_by_cause().items():
            self.backend.set("remedy_time_lost_seconds", {**run, "cause": cause}, seconds)

    def decisions(self, journaled: list[dict[str, Any]]) -> None:
        """Count the decisions journaled since the last call (the list only grows)."""
        for d in journaled[self._decisions_seen :]:
            labels = {"run_id": self.run_id, "action": str(d.get("action")),
                      "outcome": str(d.get("outcome"))}  # fmt: skip
            self.backend.inc("remedy_decisions_total", labels)
            if d.get("action") == "restart_rank" and d.get("outcome") == "applied":
                self.backend.inc(
                    "remedy_rank_restarts_total",
                    {"run_id": self.run_id},
                    len(d.get("ranks") or [1]),
                )
        self._decisions_seen = len(journaled)

    def _checkpoint_age(self) -> None:
        now = time.time()
        # Until the first checkpoint appears, look on every batch; then once a second.
        if self.checkpoints is None or (self._newest and now - self._checked < CHECKPOINT_POLL_S):
            return
        if not self._newest:
            # Listing the folder costs ~20x a stat of it, on every batch of every rank:
            # list it when an entry was added or renamed (which changes its mtime), and
            # once a second (a rename within the same coarse mtime tick).
            try:
                mtime = self.checkpoints.stat().st_mtime_ns
            except OSError:
                return
            if mtime == self._dir_mtime and now - self._checked < CHECKPOINT_POLL_S:
                return
            self._dir_mtime = mtime
        self._checked = now
        # A manifest is written after its payload: its presence marks a complete checkpoint.
        stamps = [p.stat().st_mtime for p in self.checkpoints.glob("step-*.json")]
        self._newest = max(stamps, default=self._newest)
        if self._newest:
            self.backend.set(
                "remedy_seconds_since_good_checkpoint", {"run_id": self.run_id}, now - self._newest
            )


def standalone_metrics(run_id: str, checkpoints: Path | None) -> RunMetrics | None:
    """A `/metrics` endpoint for a standalone run, if `REMEDY_METRICS_PORT` asks for one."""
    port = os.environ.get(METRICS_PORT_ENV)
    if not port:
        return None
    backend = PrometheusBackend()
    backend.serve(int(port))
    return RunMetrics(backend, run_id=run_id, checkpoints=checkpoints)
