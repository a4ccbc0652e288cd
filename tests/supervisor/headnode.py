"""A `ray start --head` cluster of a test's own, on 127.0.0.1, and its scoped teardown.

`ray stop` stops every Ray of the user on the machine (other tests' and
other people's clusters too), so it is never called: the head is started in
a session of its own and stopped by killing that session's processes, found
by their session id, plus every process below them (Ray's workers).

Each cluster gets its own `HOME` (Ray writes `~/.ray` there), `--temp-dir`
(`ray_current_cluster` is written there, read back through `RAY_TMPDIR`, so
`--address auto` finds this cluster only), free ports for everything Ray
listens on, and token authentication with a random token set in the
environment of every command, so `ray start`, `ray job submit` and `remedy`
agree on one auth mode.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tests.paths import PYTHONPATH

REPO = Path(__file__).resolve().parents[2]
# The `ray` command of this interpreter's installation (a venv's bin/), else the one on PATH.
_SIBLING = Path(sys.executable).with_name("ray")
RAY = str(_SIBLING) if _SIBLING.exists() else (shutil.which("ray") or "ray")


@dataclass
class Head:
    address: str  # GCS HOST:PORT
    dashboard: str  # http://HOST:PORT, for `ray job submit --address`
    env: dict[str, str]
    sid: int

    def run(
        self, *argv: str, timeout: float = 120, **kw: object
    ) -> subprocess.CompletedProcess[str]:
        """A command in this cluster's environment (`remedy ...` runs `python -m remedy.cli`)."""
        args = (
            [sys.executable, "-m", "remedy.cli", *argv[1:]] if argv[0] == "remedy" else list(argv)
        )
        return subprocess.run(  # type: ignore[call-overload, no-any-return]
            args, capture_output=True, text=True, check=False, timeout=timeout, env=self.env, **kw
        )


def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def env_for(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        PYTHONPATH=PYTHONPATH,
        HOME=str(root / "home"),
        REMEDY_HOME=str(root / "home" / ".remedy"),
        RAY_TMPDIR=str(root / "ray"),
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(32),
        RAY_USAGE_STATS_ENABLED="0",
    )
    return env


@contextlib.contextmanager
def head_node(
    root: Path,
    *,
    cpus: int = 2,
    resources: dict[str, float] | None = None,
    system_config: dict[str, object] | None = None,
) -> Iterator[Head]:
    """Start a head node under `root` (short: Ray's socket paths are bounded); stop only it.

    `resources`: custom resources of the head (`--resources`); `system_config`:
    Ray's internal settings for the whole cluster (only the head takes them).
    """
    for attempt in range(1, START_ATTEMPTS + 1):
        proc, head, log = _start_head(root, cpus, resources, system_config)
        try:
            _wait_ready(head, proc, root)
            break
        except RuntimeError as e:
            stop_head(head.sid)
            proc.wait(timeout=30)
            log.close()
            # Ray gives a new raylet 30 s to register with its GCS (not settable); on a
            # 2-core machine busy with the rest of the suite that window is sometimes
            # missed. That is the machine, not the code under test: start once more
            # from scratch, and say so with what the machine was doing.
            if attempt == START_ATTEMPTS or not _timed_out(root):
                raise
            print(f"ray start --head: attempt {attempt} timed out ({e}); {machine_load()}",
                  file=sys.stderr)  # fmt: skip
            (root / "ray-start.log").rename(root / f"ray-start-{attempt}.log")
            shutil.rmtree(root / "ray", ignore_errors=True)
            shutil.rmtree(root / "home", ignore_errors=True)
    try:
        yield head
    finally:
        stop_head(head.sid)
        proc.wait(timeout=30)
        log.close()


START_ATTEMPTS = 2


def _start_head(
    root: Path,
    cpus: int,
    resources: dict[str, float] | None,
    system_config: dict[str, object] | None,
) -> tuple[subprocess.Popen[bytes], Head, IO[str]]:
    (root / "home").mkdir(parents=True)
    env = env_for(root)
    gcs, dash, client, agent, metrics, rt_agent, grpc_agent = _free_ports(7)
    argv = [
        RAY, "start", "--head", "--block",
        f"--port={gcs}", f"--num-cpus={cpus}", "--num-gpus=0",
        "--node-ip-address=127.0.0.1", f"--temp-dir={root / 'ray'}",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
        f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
        f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={rt_agent}",
        f"--dashboard-agent-grpc-port={grpc_agent}", "--disable-usage-stats",
    ]  # fmt: skip
    if resources:
        argv.append(f"--resources={json.dumps(resources)}")
    if system_config:
        argv.append(f"--system-config={json.dumps(system_config)}")
    log = open(root / "ray-start.log", "w")  # noqa: SIM115 - closed by head_node
    # --block keeps `ray start` as the session leader; every Ray process it starts is in its session.
    proc = subprocess.Popen(
        argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    return proc, Head(f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dash}", env, proc.pid), log


def _timed_out(root: Path) -> bool:
    """Whether `ray start` gave up waiting for its raylet to register (the load-bound failure)."""
    text = (root / "ray-start.log").read_text()
    return "timed out during startup" in text or "Failed to get node info" in text


def machine_load(top: int = 5, window_s: float = 1.0) -> str:
    """The load average and the `top` processes busiest over `window_s`, for a failure's message."""

    def cpu_ticks() -> dict[tuple[int, str], int]:
        return {(pid, name): int(f[11]) + int(f[12]) for pid, name, f in _stats()}

    before = cpu_ticks()
    time.sleep(window_s)
    after = cpu_ticks()
    used = sorted(((t - before.get(k, t), k) for k, t in after.items()), reverse=True)[:top]
    share = 100 / (os.sysconf("SC_CLK_TCK") * window_s)
    busiest = ", ".join(f"{name}[{pid}] {t * share:.0f}%" for t, (pid, name) in used)
    return f"load average {os.getloadavg()[0]:.1f}; busiest: {busiest}"


def _wait_ready(head: Head, proc: subprocess.Popen[bytes], root: Path) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("ray start failed: " + (root / "ray-start.log").read_text()[-2000:])
        probe = head.run(RAY, "job", "list", "--address", head.dashboard, timeout=60)
        # `--address auto` reads the address file `ray start` writes; on a busy machine
        # the dashboard can answer before it is there.
        if probe.returncode == 0 and (root / "ray" / "ray_current_cluster").exists():
            return
        time.sleep(1.0)
    raise RuntimeError(
        "the head node did not come up: " + (root / "ray-start.log").read_text()[-2000:]
    )


def _stats() -> Iterator[tuple[int, str, list[str]]]:
    """(pid, name, the fields of /proc/PID/stat after the name) of every process visible."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        yield (
            int(entry.name),
            stat[stat.index("(") + 1 : stat.rindex(")")],
            stat[stat.rindex(")") + 2 :].split(),
        )


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, session id) of every live process visible in /proc."""
    # A zombie (state Z) is gone already, only not yet reaped.
    return {pid: (int(f[1]), int(f[3])) for pid, _, f in _stats() if f[0] != "Z"}


def session_pids(sid: int) -> set[int]:
    """The processes of session `sid` and everything below them."""
    procs = _processes()
    mine = {pid for pid, (_, s) in procs.items() if s == sid}
    grew = True
    while grew:
        below = {pid for pid, (ppid, _) in procs.items() if ppid in mine} - mine
        mine |= below
        grew = bool(below)
    return mine


def stop_head(sid: int) -> None:
    """SIGTERM, then SIGKILL, to the head's session and its descendants only."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in session_pids(sid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (3 if sig == signal.SIGTERM else 10)
        while session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not session_pids(sid):
            return
