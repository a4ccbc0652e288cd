"""Notify decisions reach real HTTP servers on 127.0.0.1 and commands; every delivery is journaled."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from remedy.control.effects import Notify
from remedy.policies import AnomalyEvent, Decision, Engine, NotifySink, load_policy_text
from remedy.rundir.writer import RunDir, read_jsonl
from remedy.supervisor.notify import NOTIFY_WEBHOOK_ENV, QUEUE_SIZE, Notifier, env_sinks
from tests.supervisor.core.carried import Carried

# Waiting for a delivery thread to finish, not a bound on how fast it is.
WAIT_S = 60.0


class Sink:
    """A real HTTP server in a thread that records what it is sent.

    `statuses` are answered in turn (the last one repeats); while `hold` is
    clear, each request waits for it (a slow sink).
    """

    def __init__(self, statuses: tuple[int, ...] = (200,)) -> None:
        self.statuses = list(statuses)
        self.requests: list[tuple[str, Any]] = []
        self.hold = threading.Event()
        self.hold.set()
        self.arrived = threading.Event()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                sink.requests.append((self.path, body))
                sink.arrived.set()
                sink.hold.wait(WAIT_S)
                status = sink.statuses.pop(0) if len(sink.statuses) > 1 else sink.statuses[0]
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.hold.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def sink() -> Iterator[Sink]:
    s = Sink()
    yield s
    s.close()


def closed_port() -> str:
    """A URL on 127.0.0.1 where nothing listens (a sink that is down)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/hook"


def decision(ranks: tuple[int, ...] = (1,), decision_id: str = "r-d00001") -> Decision:
    return Decision(
        decision_id=decision_id,
        step=42,
        ranks=ranks,
        rule="tell-someone",
        anomaly=AnomalyEvent("loss_spike", ranks[0], 42, value=9.5, threshold=6.0, ts=1.7e9),
        action="notify",
        params={"message": "loss spiked"},
        reason="rule tell-someone: loss_spike on rank 1 at step 42; notifying",
    )


def deliveries(path: Path, n: int) -> list[dict[str, Any]]:
    """The first `n` lines of notifications.jsonl, once they are there."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        lines = read_jsonl(path) if path.exists() else []
        if len(lines) >= n:
            return lines
        time.sleep(0.02)
    raise AssertionError(f"{n} deliveries expected in {path}, found {read_jsonl(path)}")


def notifier(tmp_path: Path, *sinks: NotifySink, **kw: Any) -> Notifier:
    return Notifier(sinks, run_id="run-1", journal=tmp_path / "notifications.jsonl",
                    backoff_s=0.01, **kw)  # fmt: skip


def test_generic_webhook_gets_the_run_rule_kind_ranks_and_step(tmp_path: Path, sink: Sink) -> None:
    """A generic webhook receives one JSON POST naming the run, rule, anomaly kind, ranks and step."""
    n = notifier(tmp_path, NotifySink("webhook", url=sink.url + "/hook"))
    note = n.submit(decision(), nodes={1: "10.0.0.7"})
    assert "webhook (generic, url)" in note
    (line,) = deliveries(tmp_path / "notifications.jsonl", 1)
    n.close()
    assert line["outcome"] == "delivered" and line["attempts"] == 1
    assert line["decision_id"] == "r-d00001" and "127.0.0.1" not in line["sink"]
    path, body = sink.requests[0]
    assert path == "/hook"
    assert body["run_id"] == "run-1" and body["rule"] == "tell-someone"
    assert body["anomaly"] == "loss_spike" and body["ranks"] == [1] and body["step"] == 42
    assert body["nodes"] == {"1": "10.0.0.7"} and body["message"] == "loss spiked"


def test_slack_webhook_gets_a_text_body(tmp_path: Path, sink: Sink) -> None:
    """format: slack posts Slack's `{"text": ...}` with the run, rule, step, kind and ranks."""
    n = notifier(tmp_path, NotifySink("webhook", url=sink.url, format="slack"))
    n.submit(decision(ranks=(0, 3)))
    deliveries(tmp_path / "notifications.jsonl", 1)
    n.close()
    (_, body), = sink.requests  # fmt: skip
    assert set(body) == {"text"}
    assert "run-1" in body["text"] and "tell-someone" in body["text"] and "step 42" in body["text"]
    assert "loss_spike on ranks 0, 3" in body["text"] and "loss spiked" in body["text"]


def test_alertmanager_gets_alerts_labelled_run_rank_node_rule(tmp_path: Path, sink: Sink) -> None:
    """Alertmanager gets POST /api/v2/alerts, one alert per rank, labelled run, rank, node and rule."""
    am = NotifySink("alertmanager", url=sink.url + "/", labels=(("team", "ml"),))
    n = notifier(tmp_path, am)
    n.submit(decision(ranks=(1, 2)), nodes={1: "10.0.0.7", 2: "10.0.0.8"})
    (line,) = deliveries(tmp_path / "notifications.jsonl", 1)
    n.close()
    assert line["outcome"] == "delivered"
    path, alerts = sink.requests[0]
    assert path == "/api/v2/alerts"
    assert [a["labels"] for a in alerts] == [
        {"alertname": "RemedyNotify", "run": "run-1", "rank": str(r), "node": node,
         "rule": "tell-someone", "anomaly": "loss_spike", "severity": "warning", "team": "ml"}
        for r, node in ((1, "10.0.0.7"), (2, "10.0.0.8"))
    ]  # fmt: skip
    assert alerts[0]["annotations"]["summary"] == "loss spiked"
    assert alerts[0]["startsAt"].startswith("2023-11-14T22:13:20")


def test_a_sink_that_is_down_fails_after_its_attempts_and_says_why(tmp_path: Path) -> None:
    """Nothing listening: every attempt is made, then the delivery is journaled as failed with the reason."""
    n = notifier(tmp_path, NotifySink("webhook", url=closed_port(), attempts=3))
    n.submit(decision())
    (line,) = deliveries(tmp_path / "notifications.jsonl", 1)
    n.close()
    assert line["outcome"] == "failed" and line["attempts"] == 3
    assert "ConnectionRefusedError" in line["error"] and "after 3 tries" in line["error"]
    assert n.counts == {"delivered": 0, "failed": 1}


def test_a_slow_sink_blocks_neither_the_caller_nor_the_other_sinks(tmp_path: Path) -> None:
    """submit returns while the slow sink still holds the request; the fast sink is served meanwhile."""
    slow, fast = Sink(), Sink()
    slow.hold.clear()
    try:
        n = notifier(
            tmp_path,
            NotifySink("webhook", url=slow.url, timeout_s=30, attempts=1),
            NotifySink("alertmanager", url=fast.url),
        )
        n.submit(decision())
        assert slow.arrived.wait(WAIT_S)
        # The slow request is still held here, and the caller is already past submit.
        assert not slow.hold.is_set()
        (line,) = deliveries(tmp_path / "notifications.jsonl", 1)
        assert line["sink"].startswith("alertmanager") and line["outcome"] == "delivered"
        slow.hold.set()
        lines = deliveries(tmp_path / "notifications.jsonl", 2)
        assert lines[1]["sink"].startswith("webhook") and lines[1]["outcome"] == "delivered"
        n.close()
    finally:
        slow.close()
        fast.close()


def test_a_sink_that_times_out_is_journaled_failed(tmp_path: Path) -> None:
    """A sink that answers later than timeout_s on every attempt: failed, timed out."""
    slow = Sink()
    slow.hold.clear()
    try:
        n = notifier(tmp_path, NotifySink("webhook", url=slow.url, timeout_s=0.2, attempts=2))
        n.submit(decision())
        (line,) = deliveries(tmp_path / "notifications.jsonl", 1)
        assert line["outcome"] == "failed" and line["attempts"] == 2
        assert "timed out" in line["error"]
        n.close(wait_s=0)
    finally:
        slow.close()


def test_server_errors_are_retried_and_client_errors_are_not(tmp_path: Path) -> None:
    """HTTP 503 then 200 is delivered on the second try; HTTP 404 fails at once."""
    flaky, wrong = Sink(statuses=(503, 200)), Sink(statuses=(404,))
    try:
        n = notifier(
            tmp_path,
            NotifySink("webhook", url=flaky.url),
            NotifySink("alertmanager", url=wrong.url),
        )
        n.submit(decision())
        lines = {x["sink"].split()[0]: x for x in deliveries(tmp_path / "notifications.jsonl", 2)}
        n.close()
        assert lines["webhook"]["outcome"] == "delivered" and lines["webhook"]["attempts"] == 2
        assert lines["alertmanager"]["outcome"] == "failed"
        assert (
            lines["alertmanager"]["attempts"] == 1 and "HTTP 404" in lines["alertmanager"]["error"]
        )
    finally:
        flaky.close()
        wrong.close()


def test_a_command_gets_the_notification_on_stdin(tmp_path: Path) -> None:
    """A command sink runs the program with the JSON on stdin and REMEDY_* variables set."""
    out = tmp_path / "got.json"
    script = (
        "import json, os, sys; body = json.load(sys.stdin); "
        f"body['env_rule'] = os.environ['REMEDY_RULE']; open({str(out)!r}, 'w').write(json.dumps(body))"
    )
    n = notifier(tmp_path, NotifySink("command", argv=(sys.executable, "-c", script)))
    n.submit(decision())
    (line,) = deliveries(tmp_path / "notifications.jsonl", 1)
    n.close()
    assert line["outcome"] == "delivered"
    body = json.loads(out.read_text())
    assert body["rule"] == body["env_rule"] == "tell-someone" and body["step"] == 42


def test_a_failing_command_is_journaled_with_its_exit_status(tmp_path: Path) -> None:
    """A command that exits 3 fails after its attempts; a missing program fails at once."""
    bad = (sys.executable, "-c", "import sys; sys.stderr.write('pager down'); sys.exit(3)")
    n = notifier(
        tmp_path,
        NotifySink("command", argv=bad, attempts=2),
        NotifySink("command", argv=(str(tmp_path / "no-such-program"),)),
    )
    n.submit(decision())
    lines = deliveries(tmp_path / "notifications.jsonl", 2)
    n.close()
    by_attempts = sorted(lines, key=lambda x: x["attempts"])
    assert by_attempts[0]["attempts"] == 1 and "cannot run" in by_attempts[0]["error"]
    assert by_attempts[1]["attempts"] == 2 and "exited 3: pager down" in by_attempts[1]["error"]


def test_a_full_queue_drops_and_journals_instead_of_waiting(tmp_path: Path) -> None:
    """With the sink's queue full, submit still returns, and the dropped one is journaled as failed."""
    slow = Sink()
    slow.hold.clear()
    try:
        n = notifier(tmp_path, NotifySink("webhook", url=slow.url, timeout_s=30, attempts=1))
        n.submit(decision(decision_id="first"))
        assert slow.arrived.wait(WAIT_S)  # the worker holds this one; the queue is empty
        for i in range(QUEUE_SIZE):
            n.submit(decision(decision_id=f"queued-{i}"))
        note = n.submit(decision(decision_id="one-too-many"))
        assert note == "every sink's queue was full"
        (line,) = deliveries(tmp_path / "notifications.jsonl", 1)
        assert line["decision_id"] == "one-too-many" and line["outcome"] == "failed"
        assert "queue full" in line["error"]
        n.close(wait_s=0)
    finally:
        slow.close()


def test_an_unset_url_variable_fails_with_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """url_env naming a variable nobody set: failed, naming the variable (not retried)."""
    monkeypatch.delenv("REMEDY_TEST_HOOK", raising=False)
    n = notifier(tmp_path, NotifySink("webhook", url_env="REMEDY_TEST_HOOK"))
    n.submit(decision())
    (line,) = deliveries(tmp_path / "notifications.jsonl", 1)
    n.close()
    assert line["attempts"] == 1 and "$REMEDY_TEST_HOOK is not set" in line["error"]


def test_the_environment_webhook_is_added_to_the_policy_sinks(tmp_path: Path, sink: Sink) -> None:
    """REMEDY_NOTIFY_WEBHOOK, carried in `env`, adds a generic webhook that gets every notify."""
    env = {NOTIFY_WEBHOOK_ENV: sink.url + "/env"}
    assert env_sinks({}) == []
    n = notifier(tmp_path, *env_sinks(env), env=env)
    n.submit(decision())
    (line,) = deliveries(tmp_path / "notifications.jsonl", 1)
    n.close()
    assert line["sink"] == f"webhook (generic, ${NOTIFY_WEBHOOK_ENV})"
    assert sink.requests[0][0] == "/env" and sink.requests[0][1]["rule"] == "tell-someone"


def test_close_journals_what_could_not_be_delivered(tmp_path: Path) -> None:
    """At the end of a run, deliveries still queued behind a stuck one are journaled as failed."""
    slow = Sink()
    slow.hold.clear()
    try:
        n = notifier(tmp_path, NotifySink("webhook", url=slow.url, timeout_s=30, attempts=1))
        n.submit(decision(decision_id="stuck"))
        assert slow.arrived.wait(WAIT_S)
        n.submit(decision(decision_id="behind"))
        n.close(wait_s=0.1)
        (line,) = read_jsonl(tmp_path / "notifications.jsonl")
        assert (
            line["decision_id"] == "behind"
            and line["error"] == "not delivered before the run ended"
        )
    finally:
        slow.close()


POLICY = """
version: 1
rules:
  - name: tell-someone
    when: {anomaly: data_stall}
    do: [{notify: {message: the loader stalled}}]
"""


def test_the_controller_hands_notify_decisions_to_its_hook(tmp_path: Path, sink: Sink) -> None:
    """A notify decision from the engine is delivered, and its journal detail names the sink."""
    engine = Engine(load_policy_text(POLICY, "p.yaml"), run_id="r")
    n = notifier(tmp_path, NotifySink("webhook", url=sink.url))

    def carry(effect: Notify) -> tuple[str, str]:
        assert effect.decision is not None
        return "applied", n.submit(effect.decision, {})

    controller = Carried(engine, world_size=1, files=RunDir(tmp_path, "r"), notify=carry)
    ev = AnomalyEvent("data_stall", 0, 5, value=3.0, threshold=1.0).to_dict()
    controller.ingest({"rank": 0, "step": 5, "events": [ev], "metrics": []})
    (line,) = deliveries(tmp_path / "notifications.jsonl", 1)
    n.close()
    controller.finish()
    (d,) = read_jsonl(tmp_path / "decisions.jsonl")
    assert d["action"] == "notify" and d["outcome"] == "applied"
    assert "sending to webhook (generic, url)" in d["detail"]
    assert line["decision_id"] == d["decision_id"] and line["outcome"] == "delivered"
    assert sink.requests[0][1]["message"] == "the loader stalled"
