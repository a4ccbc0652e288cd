"""Dashboard metrics: a standalone Guard serves /metrics, scraped for real over HTTP on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from torch import nn

from remedy.rank import Guard, GuardConfig
from remedy.rank.loop.metrics import METRICS_PORT_ENV, PrometheusBackend, RunMetrics
from tests.paths import PYTHONPATH

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    """Every remedy_ sample of the endpoint, keyed by name and labels as exposed."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in body.splitlines():
        if line.startswith("remedy_"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def test_standalone_guard_serves_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN in a standalone run shows up as an anomaly, two applied decisions, goodput below 1 and a checkpoint age."""
    port = free_port()
    monkeypatch.setenv(METRICS_PORT_ENV, str(port))
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    poisoned: list[int] = []

    def loss_fn(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        loss = m(batch).pow(2).mean()
        if guard.step_count == 25 and not poisoned:
            poisoned.append(1)
            return loss * float("nan")
        return loss

    guard = Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        loss_fn=loss_fn,
        data=lambda i: torch.randn(8, 4, generator=torch.Generator().manual_seed(i)),
        max_steps=40,
        config=GuardConfig(checkpoint_every=10),
        run_dir=tmp_path,
    )
    try:
        for batch in guard:
            guard.step(batch)
        samples = scrape(port)
    finally:
        guard.reporter.metrics.backend.close()  # type: ignore[attr-defined]
    assert samples['remedy_anomalies_total{kind="nonfinite_loss",run_id="local"}'] == 1.0
    assert (
        samples['remedy_decisions_total{action="rollback",outcome="applied",run_id="local"}'] == 1.0
    )
    assert (
        samples['remedy_decisions_total{action="shrink_lr",outcome="applied",run_id="local"}']
        == 1.0
    )
    assert 0.0 < samples['remedy_goodput_ratio{run_id="local"}'] < 1.0, "the rollback redid steps"
    assert 0.0 < samples['remedy_ettr_ratio{run_id="local"}'] < 1.0
    assert samples['remedy_time_lost_seconds{cause="nonfinite_loss",run_id="local"}'] > 0.0
    assert samples['remedy_step_time_seconds{rank="0",run_id="local"}'] > 0.0
    assert samples['remedy_seconds_since_good_checkpoint{run_id="local"}'] >= 0.0


def test_run_metrics_counts_each_decision_once_and_restarts() -> None:
    """Journaled decisions are counted once however often the list is passed; applied restarts count ranks."""
    backend = PrometheusBackend()
    port = backend.serve(0)
    try:
        metrics = RunMetrics(backend, run_id="r")
        journal = [{"action": "restart_rank", "outcome": "applied", "ranks": [1, 2]}]
        metrics.decisions(journal)
        journal.append({"action": "notify", "outcome": "suppressed"})
        metrics.decisions(journal)
        samples = scrape(port)
    finally:
        backend.close()
    assert (
        samples['remedy_decisions_total{action="restart_rank",outcome="applied",run_id="r"}'] == 1.0
    )
    assert samples['remedy_decisions_total{action="notify",outcome="suppressed",run_id="r"}'] == 1.0
    assert samples['remedy_rank_restarts_total{run_id="r"}'] == 2.0


@pytest.mark.ray
def test_ray_backend_records_in_an_actor(ray_cluster: None) -> None:
    """Inside a Ray actor every metric records with its declared tags (Ray rejects undeclared or missing ones)."""
    import ray  # noqa: PLC0415 - only this test needs Ray

    @ray.remote(num_cpus=0)
    class Recorder:
        def record(self) -> int:
            from remedy.rank.loop.metrics import RayBackend  # noqa: PLC0415 - in the actor's process

            metrics = RunMetrics(RayBackend(), run_id="r", checkpoints=None)
            batch = {"rank": 0, "step": 5, "tick": 10, "events": [{"kind": "nonfinite_loss"}],
                     "metrics": [{"step_time_s": 0.25}]}  # fmt: skip
            metrics.observe(batch)
            metrics.decisions([{"action": "restart_rank", "outcome": "applied", "ranks": [1]}])
            return metrics._decisions_seen

    recorder = Recorder.remote()  # type: ignore[attr-defined]
    assert ray.get(recorder.record.remote(), timeout=60) == 1
    ray.kill(recorder)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_ray_exporter_serves_remedy_metrics(tmp_path: Path) -> None:
    """On a private Ray with its metrics agent, Ray's export port serves the metrics an actor recorded."""
    env = {
        **os.environ,
        "PYTHONPATH": PYTHONPATH,
        "HOME": str(tmp_path),
    }
    probe = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("ray_metrics_probe.py"))],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    lines = probe.stdout.splitlines()
    assert any(
        ln.startswith("ray_remedy_anomalies_total{") and 'kind="nonfinite_loss"' in ln
        and ln.endswith(" 1.0") for ln in lines
    )  # fmt: skip
    assert any(
        ln.startswith("ray_remedy_decisions_total{") and 'action="rollback"' in ln
        and 'outcome="applied"' in ln and ln.endswith(" 1.0") for ln in lines
    )  # fmt: skip
    assert any(
        ln.startswith("ray_remedy_step_time_seconds{") and ln.endswith(" 0.25") for ln in lines
    )
    # 5 executions, 3 kept; 2 steps of 0.25 s discarded by the NaN's rollback.
    assert any(ln.startswith("ray_remedy_goodput_ratio{") and ln.endswith(" 0.6") for ln in lines)
    assert any(ln.startswith("ray_remedy_ettr_ratio{") for ln in lines)
    assert any(
        ln.startswith("ray_remedy_time_lost_seconds{") and 'cause="nonfinite_loss"' in ln
        and ln.endswith(" 0.5") for ln in lines
    )  # fmt: skip
