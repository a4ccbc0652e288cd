"""Record remedy's metrics in a Ray actor on a private Ray and scrape Ray's exporter for them.

Run by test_metrics.py in its own process (a second Ray cannot start in the
test session's): prints the scraped `ray_remedy_*` sample lines, or nothing
if none appeared within the deadline.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
import urllib.request

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
import ray

DEADLINE_S = 90.0


@ray.remote(num_cpus=0)
class Recorder:
    def record(self) -> None:
        from remedy.control.goodput import GoodputLedger  # noqa: PLC0415
        from remedy.rank.loop.metrics import RayBackend, RunMetrics  # noqa: PLC0415

        self.metrics = RunMetrics(RayBackend(), run_id="probe")
        batch = {"rank": 0, "step": 5, "tick": 10, "events": [{"kind": "nonfinite_loss"}],
                 "metrics": [{"step_time_s": 0.25}]}  # fmt: skip
        self.metrics.observe(batch)
        self.metrics.decisions([{"action": "rollback", "outcome": "applied"}])
        # Steps 0-3 of 0.25 s, then a rewind to step 2 (two discarded) decided for a NaN.
        ledger, now = GoodputLedger(), time.time()
        ledger.expect_rewind(now - 1.5, "nonfinite_loss")
        for i, step in enumerate([0, 1, 2, 3, 2]):
            rec = {"step": step, "tick": i, "step_time_s": 0.25, "t_end": now - 2 + 0.25 * i}
            ledger.record(0, rec)
        self.metrics.goodput(ledger, now - 2.0)


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(
        num_cpus=1,
        include_dashboard=True,  # Ray's metrics agent, which serves the export port
        _metrics_export_port=port,
        _node_ip_address="127.0.0.1",
        _temp_dir=tempfile.mkdtemp(prefix="rm"),
        _system_config={"metrics_report_interval_ms": 1000},
        log_to_driver=False,
        logging_level="ERROR",
    )
    try:
        recorder = Recorder.remote()  # type: ignore[attr-defined]
        ray.get(recorder.record.remote())
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    body = r.read().decode()
            except OSError:
                body = ""
            found = [ln for ln in body.splitlines() if ln.startswith("ray_remedy_")]
            if len(found) >= 6:
                print("\n".join(found))
                return
            time.sleep(1.0)
    finally:
        ray.shutdown()
    sys.exit(1)


if __name__ == "__main__":
    main()
