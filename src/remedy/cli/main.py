"""The `remedy` command line.

    remedy run TARGET [--policy FILE|NAME] [--workers N] [--run-dir DIR] [--chaos FILE]
                      [--address auto|local|ADDR] [--detach] [--dry-run] [--quiet] [-- ARGS...]
    remedy policy check FILE...      remedy policy test FILE...
    remedy policy apply FILE --run RUN_ID
    remedy report RUN_DIR [--out DIR]  remedy explain RUN_DIR [--step N | --decision ID | --rule NAME]
    remedy status [RUN_ID] [--all]   remedy logs RUN_ID [-f]
    remedy stop RUN_ID               remedy attach RUN_ID
    remedy chaos list                remedy chaos run SCENARIO... [--target T] [--workers N]

Exit status: 0 completed, 3 aborted by policy, 4 stopped (`remedy stop`), 5 degraded (it
reached its last step having stopped learning), 1 failed, 2 usage.
Bad input (a malformed policy or chaos file, an unknown target, a flag out of
range, a run directory that cannot be written, a cluster that cannot be
reached) is reported as one line before anything starts, never as a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import math
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

from remedy.cli.cluster import LOOPBACK_ENV
from remedy.cli.status_table import RECENT
from remedy.protocol.spec import NODE_AGENT_MODES

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_ABORTED, EXIT_STOPPED, EXIT_DEGRADED = 0, 1, 2, 3, 4, 5
# The run failed because its run directory could not be written (a full disk, a read-only
# or deleted directory): the summary went elsewhere (`rundir.write_errors`).
EXIT_RUN_DIR = 6
STATUS_EXIT = {
    "completed": EXIT_OK,
    "degraded": EXIT_DEGRADED,
    "aborted": EXIT_ABORTED,
    "failed": EXIT_FAILED,
    "stopped": EXIT_STOPPED,
}
MAX_WORKERS = 100_000
# A private Ray runs every rank as a process of this machine: more than this
# many per core is a typo, not a job (use --address for a cluster).
LOCAL_RANKS_PER_CORE = 8
MAX_GPUS_PER_WORKER = 1024
# Warm spares a node keeps for its own ranks (`--local-spares`): more is a typo.
MAX_LOCAL_SPARES = 64


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `remedy run: error: ...`, exit 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _whole(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number from `low` to `high`."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, not {text!r}") from None
        if not low <= n <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, not {text}")
        return n

    return parse


_workers = _whole(1, MAX_WORKERS)
_spares = _whole(0, MAX_LOCAL_SPARES)


def _gpus(text: str) -> float:
    try:
        g = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, not {text!r}") from None
    if not math.isfinite(g) or not 0 <= g <= MAX_GPUS_PER_WORKER:
        raise argparse.ArgumentTypeError(f"must be between 0 and {MAX_GPUS_PER_WORKER}, not {text}")
    return g


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, not {text!r}") from None
    if not math.isfinite(value) or not 0 < value <= 7 * 86400:
        raise argparse.ArgumentTypeError(f"must be between 0 and 604800 seconds, not {text}")
    return value


def _nonempty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    if "\x00" in text:
        raise argparse.ArgumentTypeError("must not contain a NUL byte")
    return text


_ADDRESS_HELP = (
    "Ray to run on: `local` (a private embedded Ray), `auto` (the cluster `ray start` "
    "recorded here) or HOST:PORT (default: $RAY_ADDRESS, else local)"
)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="remedy", description="Auto-remediation supervisor for PyTorch training on Ray."
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="run a training function under supervision")
    run.add_argument("target", type=_nonempty, help="path/to/file.py:function or module:function")
    run.add_argument(
        "--policy",
        type=_nonempty,
        default="default",
        help="policy file or bundled name (default: default)",
    )
    run.add_argument("--workers", type=_workers, default=1, help="number of ranks (default: 1)")
    run.add_argument("--run-dir", default="", help="run directory (default: runs/<run_id>)")
    run.add_argument("--chaos", type=_nonempty, help="chaos file of faults to inject")
    run.add_argument(
        "--resume-from",
        type=_nonempty,
        metavar="RUN_DIR",
        help="start from RUN_DIR's newest checkpoint committed by every rank, on --workers ranks "
        "(at most as many as wrote it; a sharded checkpoint is resharded)",
    )
    run.add_argument("--address", type=_nonempty, default=None, help=_ADDRESS_HELP)
    run.add_argument(
        "--detach",
        action="store_true",
        help="print the run id and return; the run goes on (needs --address auto|HOST:PORT)",
    )
    run.add_argument("--dry-run", action="store_true", help="decide and journal, but do not act")
    run.add_argument(
        "--quiet", action="store_true", help="no live display: one JSON line per event on stdout"
    )
    run.add_argument("--verbose", action="store_true", help="log every action in the ranks")
    run.add_argument(
        "--gpus-per-worker",
        type=_gpus,
        default=None,
        help="GPUs per rank (default: 1 if the cluster has one per rank, else 0)",
    )
    run.add_argument(
        "--placement",
        choices=("spread", "pack"),
        default="spread",
        help="on a cluster of several nodes: spread the ranks round-robin over the nodes other "
        "than the supervisor's, or pack each node up to its CPUs in turn (default: spread)",
    )
    run.add_argument(
        "--spares",
        type=_spares,
        default=None,
        help="warm spare actors kept ready, on the nodes with the fewest actors, to replace a "
        "lost rank at once (default: 1 when --workers is above 1, else 0)",
    )
    run.add_argument(
        "--local-spares",
        type=_spares,
        default=0,
        help="warm spares on each node that holds ranks: a rank whose process is lost while "
        "its node lives is replaced there, promoted by the node's agent (default: 0)",
    )
    run.add_argument(
        "--node-agents",
        choices=NODE_AGENT_MODES,
        default="off",
        help="one agent per node that takes its ranks' reports (auto: on when the Ray "
        "cluster has more than one node; default: off)",
    )
    run.add_argument(
        "--supervisor-timeout",
        type=_seconds,
        default=None,
        help="seconds a report may go unanswered before the supervisor counts as hung and is "
        "killed for Ray to restart (default: 20 heartbeats, at least 10)",
    )

    pol = sub.add_parser("policy", help="check, test or apply policy files")
    pol_sub = pol.add_subparsers(dest="policy_command", required=True, parser_class=_Parser)
    chk = pol_sub.add_parser("check", help="validate policy files")
    chk.add_argument("files", nargs="+")
    chk.add_argument("--strict", action="store_true", help="treat lint warnings as errors")
    # The loops of remedy.policies._loops.LOOPS (not imported here: `remedy --help` loads no
    # policy code); tests/policies/test_policies_loops.py checks they agree.
    chk.add_argument(
        "--loop",
        choices=("guard", "callbacks"),
        default="guard",
        help="the loop the policy runs under: guard (default) or callbacks (the Hugging Face "
        "and Lightning callbacks: an action they cannot carry out is an error)",
    )
    tst = pol_sub.add_parser("test", help="run policy test files")
    tst.add_argument("files", nargs="+")
    app = pol_sub.add_parser("apply", help="hot-reload a policy into a running job")
    app.add_argument("file", type=_nonempty)
    app.add_argument(
        "--run", required=True, type=_nonempty, help="the run id (see `remedy status`)"
    )
    app.add_argument("--address", type=_nonempty, default=None, help="the run's Ray cluster")

    rep = sub.add_parser(
        "report", help="summarize a run directory; write its timeline (PNG) and HTML report"
    )
    rep.add_argument("run_dir", type=_nonempty)
    rep.add_argument("--json", action="store_true", help="print the summary as JSON")
    rep.add_argument("--out", default=None, help="folder for report.png/.html (default: RUN_DIR)")
    rep.add_argument("--no-files", action="store_true", help="print the summary only")

    exp = sub.add_parser("explain", help="why a decision was taken, or what a rule did")
    exp.add_argument("run_dir")
    which = exp.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="the decisions taken at this step")
    which.add_argument("--decision", help="one decision, by id (or its unique suffix, e.g. d00002)")
    which.add_argument("--rule", help="every match, firing and hold-back of this rule")

    st = sub.add_parser("status", help="show the runs started here, or one run")
    st.add_argument("run_id", nargs="?", default=None, help="only this run")
    st.add_argument(
        "--address", type=_nonempty, default=None, help="list the runs on this Ray cluster"
    )
    st.add_argument(
        "--all", action="store_true", help=f"every run, not only the {RECENT} most recent"
    )
    st.add_argument("--json", action="store_true", help="one JSON line per run, not a table")
    lg = sub.add_parser("logs", help="a run's decisions, anomalies and the ranks' output")
    lg.add_argument("run_id", type=_nonempty)
    lg.add_argument("-f", "--follow", action="store_true", help="go on until the run ends")
    lg.add_argument("--address", type=_nonempty, default=None, help="the run's Ray cluster")
    stp = sub.add_parser("stop", help="stop a run: final checkpoint on every rank, clean end")
    stp.add_argument("run_id", type=_nonempty)
    stp.add_argument("--address", type=_nonempty, default=None, help="the run's Ray cluster")
    stp.add_argument(
        "--timeout", type=_seconds, default=300.0, help="seconds to wait for the end (300)"
    )
    stp.add_argument("--reason", type=_nonempty, default="remedy stop", help="journaled with it")
    att = sub.add_parser("attach", help="watch a running (detached) run; Ctrl-C detaches")
    att.add_argument("run_id", type=_nonempty)
    att.add_argument("--address", type=_nonempty, default=None, help="the run's Ray cluster")
    att.add_argument(
        "--quiet", action="store_true", help="no live display: one JSON line per event"
    )

    chaos = sub.add_parser("chaos", help="chaos faults")
    chaos_sub = chaos.add_subparsers(dest="chaos_command", required=True, parser_class=_Parser)
    chaos_sub.add_parser("list", help="list injectable faults")
    crun = chaos_sub.add_parser(
        "run", help="run chaos scenarios against their job and a fault-free twin; print the table"
    )
    crun.add_argument("scenarios", nargs="+", type=_nonempty, help="chaos files (scenarios)")
    crun.add_argument(
        "--target", type=_nonempty, default=None,
        help="the job to hit (default: each file's `target:`, else examples/pretrain_gpt.py:main)",
    )  # fmt: skip
    crun.add_argument(
        "--workers", type=_workers, default=None,
        help="ranks (default: each file's `workers:`, else 1)",
    )  # fmt: skip
    crun.add_argument("--run-dir", default="", help="where the runs go (default: runs/chaos-<id>)")
    crun.add_argument(
        "--json", default=None, help="write the table here (default: RUN_DIR/chaos-run.json)"
    )
    crun.add_argument("--address", type=_nonempty, default=None, help=_ADDRESS_HELP)
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
    handlers = {
        "run": _run,
        "policy": _policy,
        "report": _report,
        "explain": _explain,
        "status": _status,
        "logs": _logs,
        "stop": _stop,
        "attach": _attach,
        "chaos": _chaos,
    }
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    args.args = passthrough
    args.command_line = argv
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:
        print("remedy: interrupted", file=sys.stderr)
        return EXIT_FAILED
    except BrokenPipeError:
        # `remedy report ... | head`: the reader left; nothing more to say.
        _silence_stdout()
        return EXIT_OK
    except OSError as exc:  # a file remedy itself reads or writes: one line, never a traceback
        print(f"remedy: error: {_os_error(exc)}", file=sys.stderr)
        return EXIT_FAILED
    except Exception as exc:
        # A backstop, not the way errors are reported: each known failure has its own line.
        message = " ".join(str(exc).split())[:300]
        print(f"remedy: internal error: {type(exc).__name__}: {message}", file=sys.stderr)
        return EXIT_FAILED


def _os_error(exc: OSError) -> str:
    """`FILE: cause (ERRNO)` for an OSError (its own text if it has no errno)."""
    if exc.errno is None or exc.strerror is None:
        return " ".join(str(exc).split())[:300]
    name = errno.errorcode.get(exc.errno, str(exc.errno))
    where = f"{exc.filename}: " if exc.filename else ""
    return f"{where}{exc.strerror} ({name})"


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _usage(message: str) -> int:
    print(f"remedy: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _notify_env(sinks: Any) -> dict[str, str]:
    """The variables notify sinks read, from this environment (see `supervisor.notify`)."""
    from remedy.supervisor.notify import NOTIFY_WEBHOOK_ENV  # noqa: PLC0415 - fast --help

    names = {NOTIFY_WEBHOOK_ENV, *(s.url_env for s in sinks if s.url_env)}
    return {n: os.environ[n] for n in sorted(names) if os.environ.get(n)}


def _run(args: argparse.Namespace) -> int:
    from remedy.cli import resume as _resume  # noqa: PLC0415
    from remedy.cli.cluster import ClusterError, choose  # noqa: PLC0415
    from remedy.policies import PolicyError  # noqa: PLC0415 - keep `remedy --help` fast
    from remedy.protocol.exceptions import TargetError, UsageError  # noqa: PLC0415
    from remedy.protocol.spec import RunSpec  # noqa: PLC0415
    from remedy.rank.exceptions import ChaosConfigError  # noqa: PLC0415
    from remedy.rank.loop.target import check_target  # noqa: PLC0415
    from remedy.rundir.claim import claim_run_dir  # noqa: PLC0415
    from remedy.supervisor.policy_source import load_policy_source  # noqa: PLC0415

    # Validate everything before any training (or Ray) starts.
    try:
        target = check_target(args.target)
        policy_loaded = load_policy_source(args.policy)
        faults = _load_chaos(args.chaos, args.workers) if args.chaos else []
        choice = choose(args.address)
        if args.detach and choice.mode == "local":
            raise UsageError(
                "--detach needs a Ray cluster that outlives this command (a private local Ray "
                "stops when `remedy run` returns): start one with `ray start --head` and add "
                "--address auto, or name one with --address HOST:PORT"
            )
        if choice.mode == "local":
            most = LOCAL_RANKS_PER_CORE * (os.cpu_count() or 1)
            if args.workers > most:
                raise UsageError(
                    f"--workers {args.workers}: a local Ray runs every rank on this machine "
                    f"({os.cpu_count()} cores, at most {most} ranks); use --address for a cluster"
                )
            if args.gpus_per_worker:
                _check_gpus(args.gpus_per_worker, args.workers, _local_gpus(), "this machine")
        resume = _resume.locate(args.resume_from, args.workers) if args.resume_from else None
        policy = str(Path(args.policy).resolve()) if Path(args.policy).is_file() else args.policy
        spec = RunSpec(
            target=target,
            policy=policy,
            workers=args.workers,
            run_dir=args.run_dir,
            faults=[f.model_dump() for f in faults],
            dry_run=args.dry_run,
            argv=args.args,
            gpus_per_rank=args.gpus_per_worker or 0.0,
            verbose=args.verbose,
            notify_env=_notify_env(policy_loaded.notify),
            supervisor_timeout_s=args.supervisor_timeout,
            placement=args.placement,
            node_agents=args.node_agents,
            spares=args.spares,
            local_spares=args.local_spares,
        )
        claim = claim_run_dir(
            Path(spec.run_dir),
            given=f"--run-dir {args.run_dir}" if args.run_dir else f"run directory {spec.run_dir}",
            run_id=spec.run_id,
        )
        if resume is not None:
            _resume.seed(resume, Path(spec.run_dir))
            spec.resume = resume.to_dict()
    except (PolicyError, ChaosConfigError) as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    except (TargetError, UsageError, ClusterError) as exc:
        return _usage(str(exc))
    try:
        return _run_on_ray(spec, choice, args, claim)
    finally:
        claim.release()  # a no-op once the run has started: its directory is its record


def _local_gpus() -> int:
    import torch  # noqa: PLC0415 - only when GPUs are asked for

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def _check_gpus(per_rank: float, workers: int, available: float, where: str) -> None:
    """UsageError unless `where` has the GPUs the ranks ask for (Ray would wait for them forever)."""
    from remedy.protocol.exceptions import UsageError  # noqa: PLC0415

    need = per_rank * workers
    if need > available:
        what = (
            "no GPU is available" if not available else f"only {available:g} GPU(s) are available"
        )
        raise UsageError(
            f"--gpus-per-worker {per_rank:g} needs {need:g} GPU(s) for {workers} rank(s), "
            f"but {what} on {where}"
        )


def _load_chaos(path: str, workers: int) -> list[Any]:
    from remedy.protocol.exceptions import UsageError  # noqa: PLC0415
    from remedy.rank.chaos.faults import ChaosSetting, load_chaos  # noqa: PLC0415
    from remedy.rank.exceptions import ChaosConfigError  # noqa: PLC0415

    try:
        # Under `remedy run` there is a supervisor; what only the loop knows (its checkpoint
        # cadence, its scaler) is checked when its Guard is built.
        return list(load_chaos(path, setting=ChaosSetting(world_size=workers, supervised=True)))
    except ChaosConfigError:
        raise  # its lines are located (FILE:LINE:COL: error: ...), printed as they are
    except OSError as exc:
        raise UsageError(f"cannot read chaos file {path}: {exc.strerror}") from None
    # Untrusted input: whatever else the chaos loader trips on is a refusal of the file.
    except Exception as exc:
        raise UsageError(f"chaos file {path} cannot be loaded: {type(exc).__name__}") from None


def _run_on_ray(spec: Any, choice: Any, args: argparse.Namespace, claim: Any) -> int:
    """Connect, check the cluster's GPUs, and supervise (or detach); the exit code."""
    from remedy.cli import registry  # noqa: PLC0415 - after validation
    from remedy.cli.cluster import ClusterError, connect, disconnect, watch_run  # noqa: PLC0415
    from remedy.protocol.exceptions import UsageError  # noqa: PLC0415
    from remedy.rundir.ray_logs import wants_logs  # noqa: PLC0415

    try:
        conn = connect(choice, workers=spec.workers, quiet=True)
    except ClusterError as exc:
        if choice.mode == "local":  # this machine could not start Ray: a failure, not misuse
            print(f"remedy: error: {exc}", file=sys.stderr)
            return EXIT_FAILED
        return _usage(str(exc))
    try:
        import ray  # noqa: PLC0415

        gpus = ray.cluster_resources().get("GPU", 0)
        if args.gpus_per_worker is None:
            spec.gpus_per_rank = 1.0 if gpus >= spec.workers else 0.0
        elif spec.gpus_per_rank:
            try:
                _check_gpus(spec.gpus_per_rank, spec.workers, gpus, "the Ray cluster")
            except UsageError as exc:
                return _usage(str(exc))
        registry.register_run(spec, conn, detached=bool(args.detach))
        watch_run(spec.run_dir, spec.run_id, policy=spec.policy, workers=spec.workers)
        if not args.quiet or args.detach:
            where = (
                "a private local Ray"
                if conn.mode == "local"
                else f"the Ray cluster at {conn.address} ({conn.why})"
            )
            resumed = (
                f", resuming from step {spec.resume['step']} of {spec.resume['run_dir']} "
                f"(written by {spec.resume['writers']} rank(s))"
                if spec.resume
                else ""
            )
            print(
                f"remedy: run {spec.run_id} on {where}, "
                f"{spec.workers} rank(s), run dir {spec.run_dir}{resumed}",
                file=sys.stderr,
            )
        claim.started = True
        if args.detach:
            return _detach(spec)
        with _terminate_as_interrupt():
            return _supervise(spec, args)
    finally:
        if conn.mode == "local":
            # A private Ray ends with this command: its token opens nothing any more.
            registry.update(spec.run_id, ray_token=None)
        # What explains a failure or a supervisor's death goes with the private Ray: keep it.
        keep = conn.mode == "local" and claim.started and wants_logs(spec.run_dir)
        disconnect(conn, keep_logs_in=spec.run_dir if keep else None)


def _detach(spec: Any) -> int:
    """Start the run's supervisor and leave it running; print the run id."""
    import ray  # noqa: PLC0415

    from remedy.supervisor.actor import launch_supervisor  # noqa: PLC0415

    sup = launch_supervisor(spec)
    try:
        ray.get(sup.start.remote(), timeout=120)
    except (ray.exceptions.RayError, TimeoutError) as exc:
        ray.kill(sup, no_restart=True)
        first = " ".join(str(exc).split())[:300]
        print(f"remedy: error: the supervisor of run {spec.run_id} did not start: {first}",
              file=sys.stderr)  # fmt: skip
        return EXIT_FAILED
    print(spec.run_id, flush=True)
    print(
        f"remedy: run {spec.run_id} goes on detached: `remedy attach {spec.run_id}` shows it, "
        f"`remedy logs {spec.run_id} -f` follows it, `remedy stop {spec.run_id}` ends it",
        file=sys.stderr,
    )
    return EXIT_OK


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (`kill`, a job stop) ends the run like Ctrl-C: the private Ray is stopped, not orphaned."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread (main() called from a thread): leave signals be
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _supervise(spec: Any, args: argparse.Namespace) -> int:
    done = threading.Event()  # set before this returns: disconnect then stops the private Ray
    try:
        return _supervise_watched(spec, args, done)
    finally:
        done.set()


def _supervise_watched(spec: Any, args: argparse.Namespace, watching: threading.Event) -> int:
    import ray  # noqa: PLC0415

    from remedy.cli import registry  # noqa: PLC0415
    from remedy.cli.cluster import private_ray_gone  # noqa: PLC0415
    from remedy.cli.display import make_display  # noqa: PLC0415
    from remedy.cli.runner import format_summary, run_supervised  # noqa: PLC0415
    from remedy.protocol.exceptions import SupervisorLost, WaitTimeout  # noqa: PLC0415
    from remedy.rundir.rundata import load_run  # noqa: PLC0415

    display = make_display(quiet=args.quiet)
    threading.Thread(target=_watch_private_ray, args=(spec, display, watching), daemon=True).start()
    try:
        summary = run_supervised(spec, display=display)
    except KeyboardInterrupt:
        # run_supervised stopped the run cleanly (final checkpoint, summary.json) if it could.
        # Leave the terminal clean (the live display stopped) before main() reports it.
        display.close({"run_id": spec.run_id, "status": "interrupted"}, "")
        written = Path(spec.run_dir) / "summary.json"
        if written.exists():
            registry.update(spec.run_id, state="stopped")
            print(f"remedy: run {spec.run_id} stopped; summary in {written}", file=sys.stderr)
        raise
    except SupervisorLost as exc:
        display.close({"run_id": spec.run_id, "status": "failed"}, "")
        written = _lost_supervisor_summary(spec, str(exc))
        registry.update(spec.run_id, state="failed")
        print(
            f"remedy: error: the supervisor of run {spec.run_id} was lost: {exc}; "
            f"run failed, summary in {written}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    except (ray.exceptions.RayError, WaitTimeout) as exc:
        display.close({"run_id": spec.run_id, "status": "failed"}, "")
        gone = private_ray_gone()
        if gone is not None:
            written = _cluster_gone_summary(spec, gone)
            registry.update(spec.run_id, state="failed")
            print(
                f"remedy: error: the private Ray of run {spec.run_id} went away under it "
                f"(its {gone} ended); run failed, summary in {written}",
                file=sys.stderr,
            )
            return EXIT_FAILED
        first = " ".join(str(exc).split())[:300]
        print(
            f"remedy: error: the supervisor of run {spec.run_id} failed: {first}", file=sys.stderr
        )
        return EXIT_FAILED
    registry.update(spec.run_id, state=summary.get("status"))
    unwritten = _unwritten_run(spec, summary)
    if unwritten is not None:
        display.close({"run_id": spec.run_id, "status": "failed"}, "")
        print(unwritten[1], file=sys.stderr)
        return unwritten[0]
    gone = private_ray_gone()
    if gone is not None:
        print(
            f"remedy: error: the private Ray of run {spec.run_id} went away under it "
            f"(its {gone} ended); summary in {Path(spec.run_dir) / 'summary.json'}",
            file=sys.stderr,
        )
    run = load_run(spec.run_dir)
    text = format_summary(summary, run.decisions)
    display.close(summary, text, report=_write_report_files(run))
    for line in rank_errors(summary):
        print(line, file=sys.stderr)
    return STATUS_EXIT.get(summary["status"], EXIT_FAILED)


def _unwritten_run(spec: Any, summary: dict[str, Any]) -> tuple[int, str] | None:
    """The exit status and one line for a run that ended on an error of its own files (or
    whose supervisor failed before its summary had the totals); None for any other end."""
    where = summary.get("summary_file") or str(Path(spec.run_dir) / "summary.json")
    if summary.get("io_error"):
        return EXIT_RUN_DIR, (
            f"remedy: error: {summary['io_error']}; run {spec.run_id} failed, summary in {where}"
        )
    if "steps_completed" not in summary:  # the supervisor failed writing its summary
        error = " ".join(str(summary.get("error") or "no summary").split())[:300]
        return EXIT_FAILED, f"remedy: error: run {spec.run_id} failed: {error}"
    return None


def _watch_private_ray(spec: Any, display: Any, done: threading.Event) -> None:
    """Ray ends a process whose GCS is gone after a minute, with its own error: when a
    daemon of the private Ray ends, say so in one line, write the summary and exit first."""
    from remedy.cli import registry  # noqa: PLC0415
    from remedy.cli.cluster import abandon_private_ray, private_ray_gone  # noqa: PLC0415

    while not done.wait(1.0):
        gone = private_ray_gone()
        if gone is None:
            continue
        written = _cluster_gone_summary(spec, gone)
        registry.update(spec.run_id, state="failed")
        with contextlib.suppress(Exception):
            display.close({"run_id": spec.run_id, "status": "failed"}, "")
        print(
            f"remedy: error: the private Ray of run {spec.run_id} went away under it "
            f"(its {gone} ended); run failed, summary in {written}",
            file=sys.stderr,
            flush=True,
        )
        abandon_private_ray(keep_logs_in=spec.run_dir)
        sys.stdout.flush()
        os._exit(EXIT_FAILED)


def _cluster_gone_summary(spec: Any, gone: str) -> Path:
    """summary.json of a run whose private Ray died under it (see `write_fallback_summary`)."""
    return _lost_supervisor_summary(
        spec, f"the private Ray went away under the run (its {gone} ended)"
    )


def _lost_supervisor_summary(spec: Any, reason: str) -> Path:
    """summary.json of a run no supervisor will finish (see `write_fallback_summary`)."""
    from remedy.protocol.exceptions import SupervisorError  # noqa: PLC0415
    from remedy.rundir.rundata import write_fallback_summary  # noqa: PLC0415

    try:
        return write_fallback_summary(
            spec.run_dir, spec.run_id, reason, policy=spec.policy, workers=spec.workers
        )
    except SupervisorError as exc:
        print(f"remedy: error: {exc}", file=sys.stderr)
        return Path(spec.run_dir) / "summary.json"


def _write_report_files(run: Any) -> dict[str, str]:
    """The run's report.png and report.html; a report that fails to render never fails the run."""
    from remedy.report.html import write_report  # noqa: PLC0415 - matplotlib is slow to import

    try:
        png, page = write_report(run)
    except Exception as exc:  # the run's result matters more than its picture
        return {"error": f"report not written: {exc!r}"}
    return {"html": str(page), "png": str(png)}


def rank_errors(summary: dict[str, Any]) -> list[str]:
    """One or two lines per failed rank: its exception, and where in the user's code it was raised."""
    lines: list[str] = []
    ranks = summary.get("ranks")
    for r in ranks if isinstance(ranks, list) else []:
        if not isinstance(r, dict) or not r.get("error"):
            continue
        if r.get("config_error"):  # remedy refused the loop's input: where, and why
            lines.append(f"rank {r.get('rank', '?')} failed: {r['config_error']}")
            continue
        kind, message = r.get("error_type"), r.get("error_message")
        text = f"{kind}: {message}" if kind else str(r["error"])
        lines.append(f"rank {r.get('rank', '?')} failed: {' '.join(text.split())[:500]}")
        if r.get("error_frame"):
            lines.append(f"  at {r['error_frame']}")
    return lines


def _policy(args: argparse.Namespace) -> int:
    from remedy.policies.cli import check_main, test_main  # noqa: PLC0415

    if args.policy_command == "check":
        return check_main(args.files, strict=args.strict, loop=args.loop)
    if args.policy_command == "apply":
        return _policy_apply(args.file, args.run, args.address)
    return test_main(args.files)


def _policy_apply(file: str, run_id: str, address: str | None) -> int:
    """Send a policy to a running supervisor; it validates before swapping, so a bad file changes nothing."""
    from remedy.policies import PolicyError  # noqa: PLC0415
    from remedy.supervisor.policy_source import policy_from_bytes, read_policy_bytes  # noqa: PLC0415

    try:
        data, name = read_policy_bytes(file)
        policy_from_bytes(data, name)  # fail here, with locations, before touching the cluster
    except PolicyError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_FAILED
    import ray  # noqa: PLC0415

    from remedy.cli.run_access import (  # noqa: PLC0415
        AccessError,
        call_failed,
        find,
        live_supervisor,
    )

    try:
        ref = find(run_id, address)
        with live_supervisor(ref) as supervisor:
            try:
                errors: list[str] = ray.get(
                    supervisor.apply_policy.remote(data, file, ref.token), timeout=60
                )
            except (ray.exceptions.RayError, TimeoutError) as exc:
                raise call_failed(
                    exc, run_id, "did not take the policy; it may have ended"
                ) from None
    except AccessError as exc:
        print(f"remedy: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    for line in errors:
        print(line, file=sys.stderr)
    if errors:
        return EXIT_FAILED
    print(f"remedy: policy {file} applied to run {run_id}")
    return EXIT_OK


def _report(args: argparse.Namespace) -> int:
    from remedy.rundir.rundata import RunDirError, load_run, status_line  # noqa: PLC0415

    try:
        run = load_run(args.run_dir)
    except RunDirError as exc:
        return _usage(str(exc))
    from remedy.cli.runner import format_summary  # noqa: PLC0415 - imports Ray and torch

    if args.json:
        print(json.dumps(run.summary, indent=2, default=str))
    else:
        print(format_summary(run.summary, run.decisions))
        if run.summary_source != "summary.json":
            print(f"status: {status_line(run)}")
        for line in rank_errors(run.summary):
            print(line)
    for line in run.problems:
        print(f"remedy: warning: {line}", file=sys.stderr)
    if not args.no_files:
        from remedy.report.html import write_report  # noqa: PLC0415 - matplotlib is slow to import

        try:
            png, page = write_report(run, args.out)
            print(f"report: {page} (timeline {png})", file=sys.stderr)
        except Exception as exc:  # damaged journals may not draw; the text above still stands
            print(f"remedy: warning: report files not written: {exc!r}", file=sys.stderr)
    return EXIT_FAILED if run.summary_corrupt else EXIT_OK


def _explain(args: argparse.Namespace) -> int:
    from remedy.report.explain import explain  # noqa: PLC0415
    from remedy.rundir.rundata import RunDirError, load_run  # noqa: PLC0415

    try:
        run = load_run(args.run_dir)
        print(explain(run, step=args.step, decision=args.decision, rule=args.rule))
    except (RunDirError, LookupError) as exc:
        return _usage(str(exc))
    return EXIT_OK


def _status(args: argparse.Namespace) -> int:
    from remedy.cli.run_commands import status  # noqa: PLC0415

    address = args.address
    if address is None and args.run_id is None and os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]  # inside a Ray job: that cluster's runs
    return status(args.run_id, address, every=args.all, as_json=args.json)


def _logs(args: argparse.Namespace) -> int:
    from remedy.cli.run_commands import logs  # noqa: PLC0415

    return logs(args.run_id, follow=args.follow, address=args.address)


def _stop(args: argparse.Namespace) -> int:
    from remedy.cli.run_commands import stop  # noqa: PLC0415

    return stop(args.run_id, address=args.address, timeout_s=args.timeout, reason=args.reason)


def _attach(args: argparse.Namespace) -> int:
    from remedy.cli.run_commands import attach  # noqa: PLC0415

    return attach(args.run_id, quiet=args.quiet, address=args.address)


def _chaos(args: argparse.Namespace) -> int:
    if args.chaos_command == "run":
        from remedy.cli import chaos_run  # noqa: PLC0415 - imports Ray and torch

        return chaos_run.main(args, args.command_line)
    from remedy.rank.chaos.faults import FAULT_DESCRIPTIONS, FAULT_SIGNS  # noqa: PLC0415

    for kind, text in FAULT_DESCRIPTIONS.items():
        signs = ", ".join(FAULT_SIGNS.get(kind, ())) or "the supervisor's restart"
        print(f"{kind:<24} {text}; shows as: {signs}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
