"""Regenerate docs/demo-report.png, the README's picture of the demo's report.

Runs the demo (`examples/pretrain_gpt.py` with `examples/chaos/demo.yaml`)
under a supervisor on a private local Ray, then renders its report and
copies the timeline into docs/:

    python examples/make_report_image.py            # about a minute on 2 cores
    python examples/make_report_image.py RUN_DIR    # re-render an existing demo run
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
OUT = REPO / "docs" / "demo-report.png"


def run_demo(run_dir: Path) -> None:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
    import ray  # noqa: PLC0415 - after the environment is set

    from remedy.cli.runner import run_supervised  # noqa: PLC0415
    from remedy.protocol.spec import RunSpec  # noqa: PLC0415
    from remedy.rank.chaos.faults import load_chaos  # noqa: PLC0415

    # A private Ray: `address="auto"` could join another program's cluster.
    ray.init(
        num_cpus=max(os.cpu_count() or 1, 2),
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        logging_level="ERROR",
    )
    try:
        faults = load_chaos(HERE / "chaos" / "demo.yaml")
        spec = RunSpec(
            target=f"{HERE / 'pretrain_gpt.py'}:main",
            run_dir=str(run_dir),
            faults=[f.model_dump() for f in faults],
        )
        summary = run_supervised(spec)
        print(f"demo: {summary['status']}, {summary['steps_completed']} steps", file=sys.stderr)
    finally:
        ray.shutdown()


def main() -> None:
    from remedy.report.html import write_report  # noqa: PLC0415 - after sys.path is known

    if len(sys.argv) > 1:
        run_dir = Path(sys.argv[1])
    else:
        run_dir = Path(tempfile.mkdtemp(prefix="remedy-demo-")) / "run"
        run_demo(run_dir)
    png, page = write_report(run_dir)
    OUT.parent.mkdir(exist_ok=True)
    shutil.copyfile(png, OUT)
    print(f"{OUT} ({OUT.stat().st_size // 1024} KB); full report: {page}")


if __name__ == "__main__":
    main()
