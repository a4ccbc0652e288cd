"""Deliver `notify` decisions to people: webhooks, Alertmanager, a command.

The sinks come from the policy's `notify:` list, plus one generic webhook
when `REMEDY_NOTIFY_WEBHOOK` is set in the environment of `remedy run`
(whatever the policy says). `Notifier.submit` never blocks the caller (the
supervisor's event loop): each sink has its own bounded queue and its own
delivery thread, so a sink that is down or slow delays nothing but its own
later deliveries. A delivery is tried up to the sink's `attempts` with
exponential back-off (tenacity); connection errors, timeouts, HTTP 429 and
5xx are retried, other HTTP errors are not. Every delivery ends in one line
of `notifications.jsonl` in the run directory: `delivered` (with the
attempts it took) or `failed` with the reason; `remedy explain` shows them
under their decision.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import structlog
from tenacity import (
    RetryError,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from remedy.policies import Decision, NotifySink

log = structlog.get_logger("remedy.notify")

# `REMEDY_NOTIFY_WEBHOOK=URL` in the environment of `remedy run` sends every notify
# there too (a generic JSON POST), in addition to the policy's own sinks.
NOTIFY_WEBHOOK_ENV = "REMEDY_NOTIFY_WEBHOOK"
NOTIFICATIONS_FILE = "notifications.jsonl"
# Deliveries waiting per sink; past this a notification is dropped (and journaled as failed).
QUEUE_SIZE = 64
# At the end of a run, how long `close` waits for deliveries still queued or in flight.
CLOSE_WAIT_S = 10.0
# Alertmanager gets one alert per rank (its labels name one rank), at most this many.
MAX_ALERTS = 32
_STOP = object()


class DeliveryError(Exception):
    """A delivery that failed; `transient` ones are tried again."""

    def __init__(self, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient

    def __reduce__(self) -> tuple[Any, ...]:
        return (_delivery_error, (str(self), self.transient))


def _delivery_error(message: str, transient: bool) -> DeliveryError:
    return DeliveryError(message, transient=transient)


def env_sinks(env: Mapping[str, str]) -> list[NotifySink]:
    """The sinks the environment adds: a generic webhook when `REMEDY_NOTIFY_WEBHOOK` is set."""
    if env.get(NOTIFY_WEBHOOK_ENV):
        return [NotifySink("webhook", url_env=NOTIFY_WEBHOOK_ENV, format="generic")]
    return []


def notification(
    d: Decision, run_id: str, nodes: Mapping[int, str] | None = None
) -> dict[str, Any]:
    """The JSON a generic webhook receives for one notify decision."""
    nodes = nodes or {}
    return {
        "source": "remedy",
        "run_id": run_id,
        "decision_id": d.decision_id,
        "rule": d.rule,
        "anomaly": d.anomaly.kind,
        "severity": d.anomaly.severity,
        "ranks": list(d.ranks),
        "nodes": {str(r): nodes[r] for r in d.ranks if r in nodes},
        "step": d.step,
        "value": d.anomaly.value,
        "threshold": d.anomaly.threshold,
        "message": d.params.get("message"),
        "reason": d.reason,
        "ts": d.anomaly.ts or time.time(),
    }


def slack_body(n: Mapping[str, Any]) -> dict[str, Any]:
    """A Slack-compatible body (`text`, which Slack, Mattermost and Rocket.Chat all take)."""
    ranks = ", ".join(str(r) for r in n["ranks"][:16]) + (" ..." if len(n["ranks"]) > 16 else "")
    head = f"remedy run {n['run_id']}: rule {n['rule']} at step {n['step']}"
    what = f"{n['anomaly']} on rank{'s' if len(n['ranks']) != 1 else ''} {ranks}"
    text = f"*{head}*\n{what}\n{n['message'] or n['reason']}"
    return {"text": text}


def alertmanager_body(
    n: Mapping[str, Any], extra: Sequence[tuple[str, str]]
) -> list[dict[str, Any]]:
    """Alerts for Alertmanager's `POST /api/v2/alerts`: labels run, rank, node, rule."""
    starts = datetime.fromtimestamp(float(n["ts"]), tz=timezone.utc).isoformat()
    alerts = []
    for rank in n["ranks"][:MAX_ALERTS] or [-1]:
        labels = {
            "alertname": "RemedyNotify",
            "run": str(n["run_id"]),
            "rank": str(rank) if rank >= 0 else "",
            "node": str(n["nodes"].get(str(rank), "")),
            "rule": str(n["rule"]),
            "anomaly": str(n["anomaly"]),
            "severity": str(n["severity"]),
            **dict(extra),
        }
        alerts.append({
            "labels": {k: v for k, v in labels.items() if v},
            "annotations": {
                "summary": str(n["message"] or f"{n['anomaly']} at step {n['step']}"),
                "description": str(n["reason"]),
                "decision_id": str(n["decision_id"]),
            },
            "startsAt": starts,
        })  # fmt: skip
    return alerts


def _post(url: str, body: Any, timeout_s: float) -> None:
    data = json.dumps(body, default=str).encode()
    req = urllib.request.Request(url, data=data, method="POST")
    req.add_header("Content-Type", "application/json")
    req.add_header("User-Agent", "remedy-notify")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            resp.read(4096)
    except urllib.error.HTTPError as exc:
        raise DeliveryError(
            f"HTTP {exc.code} {exc.reason}", transient=exc.code == 429 or exc.code >= 500
        ) from None
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        raise DeliveryError(f"{type(reason).__name__}: {reason}", transient=True) from None


def _run(argv: Sequence[str], body: Mapping[str, Any], timeout_s: float) -> None:
    env = dict(os.environ)
    env.update({
        "REMEDY_RUN_ID": str(body["run_id"]),
        "REMEDY_RULE": str(body["rule"]),
        "REMEDY_ANOMALY": str(body["anomaly"]),
        "REMEDY_STEP": str(body["step"]),
        "REMEDY_RANKS": ",".join(str(r) for r in body["ranks"]),
    })  # fmt: skip
    try:
        done = subprocess.run(
            list(argv),
            input=json.dumps(body, default=str).encode(),
            capture_output=True,
            timeout=timeout_s,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise DeliveryError(f"{argv[0]} ran past {timeout_s:g} s", transient=True) from None
    except OSError as exc:
        raise DeliveryError(f"cannot run {argv[0]}: {exc.strerror}", transient=False) from None
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
        raise DeliveryError(
            f"{argv[0]} exited {done.returncode}" + (f": {tail[0][:200]}" if tail[0] else ""),
            transient=True,
        )


@dataclass
class _Job:
    decision_id: str
    body: dict[str, Any]
    queued_at: float


class _SinkWorker:
    """One sink: its queue and the thread that delivers from it."""

    def __init__(self, sink: NotifySink, url: str | None, notifier: Notifier) -> None:
        self.sink = sink
        self.url = url
        self.notifier = notifier
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=QUEUE_SIZE)
        self.thread = threading.Thread(
            target=self._loop, name=f"remedy-notify-{sink.kind}", daemon=True
        )
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.queue.get()  # next job: the sender thread idles here until close's _STOP
            if job is _STOP:
                return
            self._deliver(job)

    def _deliver(self, job: _Job) -> None:
        tries = 0
        retrying = Retrying(
            stop=stop_after_attempt(self.sink.attempts),
            wait=wait_exponential(multiplier=self.notifier.backoff_s, max=30),
            retry=retry_if_exception(lambda e: isinstance(e, DeliveryError) and e.transient),
        )
        try:
            for attempt in retrying:
                with attempt:
                    tries += 1
                    self._send(job.body)
        except RetryError as exc:
            last = exc.last_attempt.exception()
            self.notifier.record(job, self.sink, "failed", tries, f"{last} (after {tries} tries)")
        except DeliveryError as exc:
            self.notifier.record(job, self.sink, "failed", tries, str(exc))
        else:
            self.notifier.record(job, self.sink, "delivered", tries, None)

    def _send(self, body: dict[str, Any]) -> None:
        s = self.sink
        if s.kind == "command":
            _run(s.argv, body, s.timeout_s)
            return
        if self.url is None:
            raise DeliveryError(
                f"${s.url_env} is not set in the environment of `remedy run`", transient=False
            )
        if s.kind == "alertmanager":
            _post(self.url.rstrip("/") + "/api/v2/alerts", alertmanager_body(body, s.labels),
                  s.timeout_s)  # fmt: skip
        elif s.format == "slack":
            _post(self.url, slack_body(body), s.timeout_s)
        else:
            _post(self.url, body, s.timeout_s)


class Notifier:
    """Queues notify decisions for every sink and journals how each delivery ended.

    `env` holds the variables `url_env` names (what `remedy run` carried over
    from its environment); `journal`, the file each delivery's line goes to
    (None: logged only).
    """

    def __init__(
        self,
        sinks: Sequence[NotifySink],
        *,
        run_id: str,
        env: Mapping[str, str] | None = None,
        journal: Path | None = None,
        backoff_s: float = 0.5,
        on_record: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.run_id = run_id
        self.env = dict(env or {})
        self.journal = journal
        self.backoff_s = backoff_s
        self.on_record = on_record
        self._lock = threading.Lock()
        self.counts = {"delivered": 0, "failed": 0}
        self.workers = [self._worker(s) for s in sinks]

    def _worker(self, sink: NotifySink) -> _SinkWorker:
        url = sink.url
        if sink.url_env is not None:
            url = self.env.get(sink.url_env) or os.environ.get(sink.url_env) or None
        return _SinkWorker(sink, url, self)

    def submit(self, d: Decision, nodes: Mapping[int, str] | None = None) -> str:
        """Queue `d` for every sink at once (never waits); the note for the decision's detail."""
        if not self.workers:
            return "no sinks configured"
        body = notification(d, self.run_id, nodes)
        names = []
        for w in self.workers:
            job = _Job(d.decision_id, body, time.time())
            try:
                w.queue.put_nowait(job)
            except queue.Full:
                self.record(job, w.sink, "failed", 0, f"queue full ({QUEUE_SIZE} waiting)")
                continue
            names.append(w.sink.describe())
        if not names:
            return "every sink's queue was full"
        return f"sending to {', '.join(names)} (see {NOTIFICATIONS_FILE})"

    def record(
        self, job: _Job, sink: NotifySink, outcome: str, attempts: int, error: str | None
    ) -> None:
        """One delivery's end: a line in the journal, a log line, the counts."""
        line: dict[str, Any] = {
            "ts": time.time(),
            "run_id": self.run_id,
            "decision_id": job.decision_id,
            "sink": sink.describe(),
            "outcome": outcome,
            "attempts": attempts,
            "latency_s": round(time.time() - job.queued_at, 3),
        }
        if error is not None:
            line["error"] = error
        with self._lock:
            self.counts[outcome] = self.counts.get(outcome, 0) + 1
            if self.journal is not None:
                try:
                    with self.journal.open("a", encoding="utf-8") as fh:
                        fh.write(json.dumps(line) + "\n")
                except OSError as exc:
                    log.warning("notify_journal_failed", error=str(exc))
        if outcome == "delivered":
            log.info("notify_delivered", sink=line["sink"], decision=job.decision_id)
        else:
            log.warning("notify_failed", sink=line["sink"], decision=job.decision_id, error=error)
        if self.on_record is not None:
            with contextlib.suppress(Exception):
                self.on_record(line)

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Let queued deliveries finish for up to `wait_s`; journal the rest as failed."""
        deadline = time.monotonic() + wait_s
        for w in self.workers:
            with contextlib.suppress(queue.Full):
                w.queue.put(_STOP, timeout=max(0.0, deadline - time.monotonic()))
        for w in self.workers:
            w.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        for w in self.workers:
            if not w.thread.is_alive():
                continue
            while True:
                try:
                    job = w.queue.get_nowait()
                except queue.Empty:
                    break
                if job is not _STOP:
                    self.record(job, w.sink, "failed", 0, "not delivered before the run ended")
