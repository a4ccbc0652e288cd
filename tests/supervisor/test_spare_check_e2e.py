"""A warm spare that answers no ping is killed, refilled and skipped: the restart takes the next spare."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from remedy.cli.runner import run_supervised
from remedy.protocol.spec import NAMESPACE, RunSpec
from remedy.rundir.writer import read_jsonl
from remedy.supervisor.worker_group import spare_name

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
TARGET = f"{REPO / 'examples' / 'pretrain_gpt.py'}:main"
ARGS = ["--steps", "40", "--layers", "1", "--width", "32", "--batch-size", "4",
        "--block-size", "32", "--sample-every", "0"]  # fmt: skip


def _stop_when_up(name: str, stopped: list[int], done: threading.Event) -> None:
    """SIGSTOP the actor `name` as soon as it answers where it runs."""
    while not done.is_set():
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:  # not created yet
            time.sleep(0.1)
            continue
        with contextlib.suppress(ray.exceptions.RayError):
            pid = ray.get(actor.where.remote(), timeout=10)[1]  # (node, pid, node id, start)
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
            return
        time.sleep(0.1)


@pytest.mark.timeout(240)
def test_a_stopped_spare_is_skipped(ray_cluster: None, tmp_path: Path) -> None:
    """Spare 1 is SIGSTOPped, then rank 1 hangs: spare 1 is skipped, spare 2 replaces rank 1, the run completes."""
    spec = RunSpec(
        target=TARGET, workers=2, run_dir=str(tmp_path), argv=ARGS, threads_per_rank=1,
        faults=[{"kind": "hang_rank", "at_step": 20, "rank": 1}], spares=2,
        hang_watch={"first_step_s": 4.0},
    )  # fmt: skip
    first = spare_name(spec.run_id, 1)
    stopped: list[int] = []
    done = threading.Event()
    stopper = threading.Thread(target=_stop_when_up, args=(first, stopped, done), daemon=True)
    stopper.start()
    try:
        summary: dict[str, Any] = run_supervised(spec)
    finally:
        done.set()
        stopper.join(timeout=15)
        for pid in stopped:  # the process stopped here, if the run left it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert stopped, "spare 1 never came up"
    assert summary["status"] == "completed", summary
    [record] = summary["recoveries"]
    assert record["skipped_spares"] == [first]
    assert record["replacements"] == {"1": "warm spare"}
    [restart] = [
        d for d in read_jsonl(tmp_path / "decisions.jsonl") if d["action"] == "restart_rank"
    ]
    assert restart["outcome"] == "applied"
    assert f"skipped {first}" in restart["detail"], restart["detail"]
