"""The `remedy` command line.

    remedy run TARGET [--policy FILE|NAME] [--workers N] [--run-dir DIR] [--chaos FILE]
                      [--dry-run] [--quiet] [-- ARGS...]
    remedy policy check FILE...      remedy policy test FILE...
    remedy report RUN_DIR [--out DIR]  remedy explain RUN_DIR [--step N | --decision ID | --rule NAME]
    remedy status            remedy chaos list

Exit status: 0 completed, 3 aborted by policy, 1 failed, 2 usage.
Bad input (a malformed policy or chaos file, an unknown target) is reported
as located one-line errors before anything starts, never as a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from remedy.supervisor.cluster import LOOPBACK_ENV

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_ABORTED = 0, 1, 2, 3
STATUS_EXIT = {"completed": EXIT_OK, "aborted": EXIT_ABORTED, "failed": EXIT_FAILED}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="remedy", description="Auto-remediation supervisor for PyTorch training on Ray."
    )
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a training function under supervision")
    run.add_argument("target", help="path/to/file.py:function or module:function")
    run.add_argument(
        "--policy", default="default", help="policy file or bundled name (default: default)"
    )
    run.add_argument("--workers", type=int, default=1, help="number of ranks (default: 1)")
    run.add_argument("--run-dir", default="", help="run directory (default: runs/<run_id>)")
    run.add_argument("--chaos", help="chaos file of faults to inject")
    run.add_argument("--dry-run", action="store_true", help="decide and journal, but do not act")
    run.add_argument(
        "--quiet", action="store_true", help="no live display: one JSON line per event on stdout"
    )
    run.add_argument("--verbose", action="store_true", help="log every action in the ranks")
    run.add_argument(
        "--gpus-per-worker",
        type=float,
        default=None,
        help="GPUs per rank (default: 1 if any, else 0)",
    )

    pol = sub.add_parser("policy", help="check or test policy files")
    pol_sub = pol.add_subparsers(dest="policy_command", required=True)
    chk = pol_sub.add_parser("check", help="validate policy files")
    chk.add_argument("files", nargs="+")
    chk.add_argument("--strict", action="store_true", help="treat lint warnings as errors")
    tst = pol_sub.add_parser("test", help="run policy test files")
    tst.add_argument("files", nargs="+")
    app = pol_sub.add_parser("apply", help="hot-reload a policy into a running job")
    app.add_argument("file")
    app.add_argument("--run", required=True, help="the run id (see `remedy status`)")

    rep = sub.add_parser(
        "report", help="summarize a run directory; write its timeline (PNG) and HTML report"
    )
    rep.add_argument("run_dir")
    rep.add_argument("--json", action="store_true", help="print the summary as JSON")
    rep.add_argument("--out", default=None, help="folder for report.png/.html (default: RUN_DIR)")
    rep.add_argument("--no-files", action="store_true", help="print the summary only")

    exp = sub.add_parser("explain", help="why a decision was taken, or what a rule did")
    exp.add_argument("run_dir")
    which = exp.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="the decisions taken at this step")
    which.add_argument("--decision", help="one decision, by id (or its unique suffix, e.g. d00002)")
    which.add_argument("--rule", help="every match, firing and hold-back of this rule")

    sub.add_parser("status", help="show supervised runs on the current Ray cluster")

    chaos = sub.add_parser("chaos", help="chaos faults")
    chaos_sub = chaos.add_subparsers(dest="chaos_command", required=True)
    chaos_sub.add_parser("list", help="list injectable faults")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after `--` belongs to the training function, untouched.
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    # Set before Ray is imported anywhere in this process (see supervisor.cluster).
    os.environ.setdefault(LOOPBACK_ENV, "0")
    args = _parser().parse_args(argv)
    args.args = passthrough
    handlers = {
        "run": _run,
        "policy": _policy,
        "report": _report,
        "explain": _explain,
        "status": _status,
        "chaos": _chaos,
    }
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:
        print("remedy: interrupted", file=sys.stderr)
        return EXIT_FAILED


def _run(args: argparse.Namespace) -> int:
    from remedy.policies import PolicyError, load_policy  # noqa: PLC0415 - keep `remedy --help` fast
    from remedy.supervisor.exceptions import TargetError  # noqa: PLC0415
    from remedy.supervisor.target import split_target  # noqa: PLC0415
    from remedy.workers.chaos import load_chaos  # noqa: PLC0415
    from remedy.workers.exceptions import ChaosConfigError  # noqa: PLC0415

    if args.workers < 1:
        print("remedy: error: --workers must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    try:
        split_target(args.target)
        where = args.target.rpartition(":")[0]
        if where.endswith(".py") and not Path(where).is_file():
            raise TargetError(f"target file {where} does not exist")
        # Validate everything before any training starts.
        load_policy(args.policy)
        faults = load_chaos(args.chaos) if args.chaos else []
    except PolicyError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    except (ChaosConfigError, TargetError) as exc:
        print(f"remedy: error: {exc}", file=sys.stderr)
        return EXIT_USAGE

    from remedy.supervisor.cluster import connect  # noqa: PLC0415
    from remedy.supervisor.display import make_display  # noqa: PLC0415
    from remedy.supervisor.runner import format_summary, run_supervised  # noqa: PLC0415
    from remedy.supervisor.spec import RunSpec  # noqa: PLC0415
    from remedy.workers.rundir import read_jsonl  # noqa: PLC0415

    passthrough = args.args
    policy = str(Path(args.policy).resolve()) if Path(args.policy).is_file() else args.policy
    target = args.target
    if where.endswith(".py"):
        target = f"{Path(where).resolve()}:{args.target.rpartition(':')[2]}"
    mode = connect(workers=args.workers, quiet=True)
    gpus = args.gpus_per_worker
    if gpus is None:
        import ray  # noqa: PLC0415

        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= args.workers else 0.0
    spec = RunSpec(
        target=target,
        policy=policy,
        workers=args.workers,
        run_dir=args.run_dir,
        faults=[f.model_dump() for f in faults],
        dry_run=args.dry_run,
        argv=passthrough,
        gpus_per_rank=gpus,
        verbose=args.verbose,
    )
    if not args.quiet:
        print(
            f"remedy: run {spec.run_id} on {mode} Ray, {args.workers} rank(s), run dir {spec.run_dir}",
            file=sys.stderr,
        )
    display = make_display(quiet=args.quiet)
    try:
        summary = run_supervised(spec, display=display)
    except KeyboardInterrupt:
        # Leave the terminal clean (the live display stopped) before main() reports it.
        display.close({"run_id": spec.run_id, "status": "interrupted"}, "")
        raise
    text = format_summary(summary, read_jsonl(Path(spec.run_dir) / "decisions.jsonl"))
    display.close(summary, text, report=_write_report_files(spec.run_dir))
    return STATUS_EXIT.get(summary["status"], EXIT_FAILED)


def _write_report_files(run_dir: str) -> dict[str, str]:
    """The run's report.png and report.html; a report that fails to render never fails the run."""
    from remedy.supervisor.report import write_report  # noqa: PLC0415 - matplotlib is slow to import

    try:
        png, page = write_report(run_dir)
    except Exception as exc:  # the run's result matters more than its picture
        return {"error": f"report not written: {exc!r}"}
    return {"html": str(page), "png": str(png)}


def _policy(args: argparse.Namespace) -> int:
    from remedy.policies.cli import check_main, test_main  # noqa: PLC0415

    if args.policy_command == "check":
        return check_main(args.files, strict=args.strict)
    if args.policy_command == "apply":
        return _policy_apply(args.file, args.run)
    return test_main(args.files)


def _policy_apply(file: str, run_id: str) -> int:
    """Send a policy to a running supervisor; it validates before swapping, so a bad file changes nothing."""
    from remedy.policies import PolicyError, load_policy  # noqa: PLC0415

    try:
        load_policy(file)  # fail here, with locations, before touching the cluster
    except PolicyError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_FAILED
    supervisor = _find_supervisor(run_id)
    if supervisor is None:
        print(f"remedy: error: no running supervisor for run {run_id!r}", file=sys.stderr)
        return EXIT_FAILED
    import ray  # noqa: PLC0415

    errors: list[str] = ray.get(supervisor.apply_policy.remote(Path(file).read_text(), file))
    for line in errors:
        print(line, file=sys.stderr)
    if errors:
        return EXIT_FAILED
    print(f"remedy: policy {file} applied to run {run_id}")
    return EXIT_OK


def _find_supervisor(run_id: str) -> Any | None:
    import ray  # noqa: PLC0415

    if not ray.is_initialized():
        try:
            ray.init(address="auto", logging_level=logging.ERROR, log_to_driver=False)
        except ConnectionError:
            return None
    try:
        return ray.get_actor(f"remedy-supervisor-{run_id}", namespace="remedy")
    except ValueError:
        return None


def _report(args: argparse.Namespace) -> int:
    from remedy.supervisor.rundata import RunDirError, load_run, status_line  # noqa: PLC0415
    from remedy.supervisor.runner import format_summary  # noqa: PLC0415

    try:
        run = load_run(args.run_dir)
    except RunDirError as exc:
        print(f"remedy: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(run.summary, indent=2))
    else:
        print(format_summary(run.summary, run.decisions))
        if run.summary_source != "summary.json":
            print(f"status: {status_line(run)}")
    if not args.no_files:
        from remedy.supervisor.report import write_report  # noqa: PLC0415 - matplotlib is slow to import

        png, page = write_report(run.path, args.out)
        print(f"report: {page} (timeline {png})", file=sys.stderr)
    return EXIT_OK


def _explain(args: argparse.Namespace) -> int:
    from remedy.supervisor.explain import explain  # noqa: PLC0415
    from remedy.supervisor.rundata import RunDirError, load_run  # noqa: PLC0415

    try:
        run = load_run(args.run_dir)
        print(explain(run, step=args.step, decision=args.decision, rule=args.rule))
    except (RunDirError, LookupError) as exc:
        print(f"remedy: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK


def _status(args: argparse.Namespace) -> int:
    import ray  # noqa: PLC0415

    try:
        ray.init(address="auto", logging_level=logging.ERROR, log_to_driver=False)
    except ConnectionError:
        print("remedy: no Ray cluster is running here")
        return EXIT_OK
    from ray.util.state import list_actors  # noqa: PLC0415

    found = 0
    for actor in list_actors(filters=[("state", "=", "ALIVE")]):
        name = actor.name or ""
        if name.startswith("remedy-supervisor-"):
            handle: Any = ray.get_actor(name, namespace="remedy")
            status: dict[str, Any] = ray.get(handle.status.remote())
            print(json.dumps(status))
            found += 1
    if not found:
        print("remedy: no supervised runs on this cluster")
    return EXIT_OK


def _chaos(args: argparse.Namespace) -> int:
    from remedy.workers.chaos import FAULT_DESCRIPTIONS  # noqa: PLC0415

    for kind, text in FAULT_DESCRIPTIONS.items():
        print(f"{kind:<24} {text}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
