"""Which Ray a run uses: a named cluster, or a private embedded one that nothing else joins.

`remedy run --address` chooses (the CLI contract):

| `--address` | Ray used |
| --- | --- |
| not given | `RAY_ADDRESS` (also what a `ray job submit` entrypoint gets), else `local` |
| `local` | a private embedded Ray, whatever the environment says |
| `auto` | `RAY_ADDRESS`, else the cluster `ray start` recorded on this machine |
| `HOST:PORT` | that cluster (its GCS address) |

A private Ray lives in its own temporary directory, so `ray start`'s
address file never names it, and takes a random authentication token of its
own, so a process that finds it anyway (Ray's `address="auto"` also scans
the process table) is refused instead of attaching to it and dying with it.
A named cluster is probed before `ray.init`: one gRPC call with a short
deadline, so an unreachable address or a refused token is one line within
seconds instead of minutes of Ray's own retries.

A private Ray is watched by a process of its own (`cli.ray_watchdog`) that
ends it, keeps the run's logs and removes its directory if the driver dies
without stopping it (a SIGKILL); `disconnect` stands it down. Where a run
failed or its supervisor died, `disconnect` keeps the private Ray's logs in
the run directory first (`rundir.ray_logs`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from remedy.cli import ray_watchdog
from remedy.protocol.exceptions import ClusterError
from remedy.rundir.ray_logs import keep_logs

# Ray advertises the host's network address unless this is set before it
# starts; remedy's local clusters stay on loopback. An explicit setting in
# the environment wins.
# On the Ray remedy starts: how long the raylet waits for a killed worker before SIGKILL.
KILL_WORKER_TIMEOUT_MS = 100
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# The environment variable naming the cluster to join. `--address` wins over it.
ADDRESS_ENV = "RAY_ADDRESS"
# Ray's token authentication settings, read by every Ray process of a private cluster.
AUTH_MODE_ENV = "RAY_AUTH_MODE"
AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"
AUTH_TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
PRIVATE_PREFIX = "remedy-ray-"
# How long the reachability probe of a named cluster may take, per step.
PROBE_TIMEOUT_S = 3.0
# Longer temporary folders would push Ray's socket paths past the kernel's limit.
MAX_TEMP_BASE = 40


@dataclass(frozen=True)
class Choice:
    """The Ray a command will use: `mode` is "local" or "cluster"; `why` says what chose it."""

    mode: str
    address: str | None
    why: str


@dataclass
class Connection:
    """A connected Ray: what `disconnect` must undo, and what other commands need to reach it."""

    mode: str
    address: str
    why: str
    token: str | None = None
    temp_dir: str | None = None


def choose(flag: str | None, environ: dict[str, str] | None = None) -> Choice:
    """Decide from `--address` and the environment which Ray to use (no I/O but `ray start`'s file)."""
    env = os.environ if environ is None else environ
    named = (env.get(ADDRESS_ENV) or "").strip()
    if flag is None or flag == "":
        if named in ("auto", "local"):
            # Ray's own spellings: treated as the same words given to --address.
            return choose(named, {k: v for k, v in env.items() if k != ADDRESS_ENV})
        if named:
            return Choice("cluster", named, f"${ADDRESS_ENV}")
        return Choice("local", None, "default")
    flag = flag.strip()
    if flag == "local":
        return Choice("local", None, "--address local")
    if flag == "auto":
        if named and named != "auto":
            return Choice("cluster", named, f"--address auto (${ADDRESS_ENV})")
        recorded = _recorded_address(env)
        if recorded is None:
            where = _address_file(env)
            hint = (
                f"RAY_TMPDIR={env['RAY_TMPDIR']} names the `ray start --temp-dir` to look in"
                if env.get("RAY_TMPDIR")
                else "a `ray start --temp-dir DIR` cluster is found with RAY_TMPDIR=DIR"
            )
            raise ClusterError(
                f"--address auto: no running Ray cluster found on this machine ({where} "
                f"names none; {hint}); start one with `ray start --head`, name one with "
                "--address HOST:PORT, or use --address local"
            )
        return Choice("cluster", recorded, "--address auto (ray start)")
    return Choice("cluster", flag, "--address")


def _address_file(env: Any) -> Path:
    """Where `ray start` records its address: in its --temp-dir, which RAY_TMPDIR names."""
    temp = env.get("RAY_TMPDIR") or os.path.join(tempfile.gettempdir(), "ray")
    return Path(temp) / "ray_current_cluster"


def _recorded_address(env: Any) -> str | None:
    """The GCS address the last `ray start` on this machine wrote, if any."""
    try:
        text = _address_file(env).read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None
    return text or None


def probe(address: str, *, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Raise ClusterError, with one line of reason, unless `address` is a Ray GCS that accepts us.

    Returns whether the cluster requires a token (and accepts ours).
    """
    if address.startswith("ray://"):
        # Ray Client goes through its own server; only its reachability can be checked here.
        _tcp_check(address.removeprefix("ray://"), address, timeout_s)
        return False
    if "://" in address:
        raise ClusterError(
            f"--address {address}: give the cluster's GCS address HOST:PORT (port 6379 by default), "
            "not a URL"
        )
    _tcp_check(address, address, timeout_s)
    import grpc  # type: ignore[import-untyped]  # noqa: PLC0415 - only when a named cluster is probed
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc  # noqa: PLC0415

    def ask(metadata: tuple[tuple[str, str], ...]) -> Any:
        """None if the GCS answered, else the gRPC status code."""
        with grpc.insecure_channel(address) as channel:
            stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
            try:
                stub.GetClusterId(
                    gcs_service_pb2.GetClusterIdRequest(),  # type: ignore[attr-defined]
                    timeout=timeout_s,
                    metadata=metadata,
                )
            except grpc.RpcError as exc:
                return exc
        return None

    failure = ask(())
    if failure is None:
        return False
    token = _auth_metadata()
    if failure.code() == grpc.StatusCode.UNAUTHENTICATED:
        if not token:
            raise ClusterError(
                f"Ray cluster at {address} requires an authentication token and none is set "
                f"(set {AUTH_TOKEN_ENV} or {AUTH_TOKEN_PATH_ENV} to the cluster's token)"
            )
        failure = ask(token)
        if failure is None:
            return True
    if failure.code() == grpc.StatusCode.UNAUTHENTICATED:
        raise ClusterError(
            f"Ray cluster at {address} refused remedy's authentication token "
            f"(set {AUTH_TOKEN_ENV} or {AUTH_TOKEN_PATH_ENV} to the cluster's token)"
        )
    raise ClusterError(
        f"no Ray cluster answers at {address} ({failure.code().name.lower()}: {failure.details()})"
    )


def _tcp_check(hostport: str, address: str, timeout_s: float) -> None:
    host, sep, port_s = hostport.rpartition(":")
    if not sep or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ClusterError(f"--address {address}: expected HOST:PORT, `auto` or `local`")
    try:
        with socket.create_connection((host.strip("[]"), int(port_s)), timeout=timeout_s):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ClusterError(f"no Ray cluster answers at {address}: {reason}") from None


def _auth_metadata() -> tuple[tuple[str, str], ...]:
    """The token Ray itself would send: $RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token."""
    token = os.environ.get(AUTH_TOKEN_ENV, "").strip()
    if not token:
        path = os.environ.get(AUTH_TOKEN_PATH_ENV) or str(Path.home() / ".ray" / "auth_token")
        with contextlib.suppress(OSError):
            token = Path(path).read_text(encoding="utf-8", errors="replace").strip()
    return (("authorization", f"Bearer {token}"),) if token else ()


def connect(
    choice: Choice, *, workers: int = 1, quiet: bool = True, token: str | None = None
) -> Connection:
    """Join the chosen cluster (probed first) or start a private embedded Ray.

    `token` joins a private Ray of another run (from its registry entry).
    """
    os.environ.setdefault(LOOPBACK_ENV, "0")
    ray_module = sys.modules.get("ray")
    if ray_module is not None and ray_module.is_initialized():
        # The calling program (a notebook, a test, a driver calling `main()`) connected
        # already: Ray allows one connection per process, so the run uses that one and
        # leaves it connected afterwards.
        address = ray_module.get_runtime_context().gcs_address
        return Connection("attached", str(address), "this process's Ray connection")
    common: dict[str, Any] = {
        "log_to_driver": not quiet,
        "configure_logging": True,
        "logging_level": logging.ERROR,
    }
    if choice.mode == "cluster":
        assert choice.address is not None
        if token is not None:
            _use_token(token)
        try:
            needs_token = probe(choice.address)
        except ClusterError as exc:
            if choice.why.startswith("$"):
                raise ClusterError(f"{exc} (from {choice.why})") from None
            raise
        if needs_token and os.environ.get(AUTH_MODE_ENV, "").lower() != "token":
            if os.environ.get(AUTH_MODE_ENV, "").lower() == "disabled":
                raise ClusterError(
                    f"Ray cluster at {choice.address} requires token authentication, "
                    f"but {AUTH_MODE_ENV}=disabled here"
                )
            # Ray sends its token only in token mode; the cluster asks for one.
            _set_token_mode()
        import ray  # noqa: PLC0415 - after the environment is set

        # `--address` wins over $RAY_ADDRESS, which ray.init would otherwise prefer.
        os.environ.pop(ADDRESS_ENV, None)
        try:
            ray.init(address=choice.address, **common)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ClusterError(f"cannot join the Ray cluster at {choice.address}: {exc}") from None
        return Connection("cluster", choice.address, choice.why, token=token)
    return _start_private(workers, common)


def _start_private(workers: int, common: dict[str, Any]) -> Connection:
    # Nothing in the environment may point this process at another cluster.
    os.environ.pop(ADDRESS_ENV, None)
    token = secrets.token_hex(32)
    _use_token(token)
    # Ray's Unix sockets live under this folder, and their paths are limited to ~107 bytes.
    base = tempfile.gettempdir()
    if len(base) > MAX_TEMP_BASE and os.access("/tmp", os.W_OK):
        base = "/tmp"
    temp_dir = tempfile.mkdtemp(prefix=PRIVATE_PREFIX, dir=base)
    # Watching from before Ray starts: a driver killed while Ray starts leaves nothing either.
    _WATCHDOG[:] = [dog] if (dog := ray_watchdog.start(token, temp_dir)) is not None else []
    import ray  # noqa: PLC0415 - after the environment is set

    cpus = max(os.cpu_count() or 1, workers + 1)
    try:
        ray.init(
            num_cpus=cpus,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            _temp_dir=temp_dir,
            # ray.kill() of a stopped (hung) actor waits this long before SIGKILL (default 5 s).
            _system_config={"kill_worker_timeout_milliseconds": KILL_WORKER_TIMEOUT_MS},
            **common,
        )
    except Exception as exc:
        shutil.rmtree(temp_dir, ignore_errors=True)
        _stand_down()
        first = " ".join(str(exc).split())[:300]
        raise ClusterError(f"cannot start a private Ray: {type(exc).__name__}: {first}") from None
    except BaseException:
        shutil.rmtree(temp_dir, ignore_errors=True)
        _stand_down()
        raise
    address = ray.get_runtime_context().gcs_address
    _PRIVATE_DAEMONS.clear()
    _PRIVATE_DAEMONS.update(_daemons_of(os.getpid()))
    _PRIVATE_TEMP[:] = [temp_dir]
    return Connection("local", address, "private", token=token, temp_dir=temp_dir)


# The private Ray's own processes (pid -> name), children of the process that started it.
_PRIVATE_DAEMONS: dict[int, str] = {}
_DAEMON_NAMES = ("raylet", "gcs_server")
_PRIVATE_TEMP: list[str] = []
# The private Ray's watchdog (`cli.ray_watchdog`), while one runs.
_WATCHDOG: list[ray_watchdog.Watchdog] = []


def watch_run(run_dir: str, run_id: str, **summary: Any) -> None:
    """Tell the private Ray's watchdog which run it carries: if the driver dies, that run's logs
    are kept and its summary written (`summary` holds fields for it)."""
    for dog in _WATCHDOG:
        dog.watch_run(run_dir, run_id, **summary)


def _stand_down() -> None:
    while _WATCHDOG:
        _WATCHDOG.pop().stand_down()


def _stat(pid: int) -> tuple[str, str, int] | None:
    """(name, state, parent pid) of a process from /proc, or None if it is not there."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    head, _, rest = text.rpartition(")")
    fields = rest.split()
    if len(fields) < 2 or not fields[1].lstrip("-").isdigit():
        return None
    return head.partition("(")[2], fields[0], int(fields[1])


def _daemons_of(parent: int) -> dict[int, str]:
    found: dict[int, str] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (st := _stat(int(entry))) is not None:
                name, _, ppid = st
                if ppid == parent and name in _DAEMON_NAMES:
                    found[int(entry)] = name
    return found


def abandon_private_ray(keep_logs_in: str | None = None) -> None:
    """After part of the private Ray died: end the rest of it (its raylet ends the ranks'
    processes; the watchdog, once this process exits, what stays) and remove its directory,
    keeping its logs in `keep_logs_in` first; this process cannot use Ray any more."""
    for pid, name in _PRIVATE_DAEMONS.items():
        st = _stat(pid)
        if st is not None and st[0] == name and st[1] not in ("Z", "X"):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
    for temp_dir in _PRIVATE_TEMP:
        if keep_logs_in is not None:
            keep_logs(temp_dir, keep_logs_in)
        shutil.rmtree(temp_dir, ignore_errors=True)


def private_ray_gone() -> str | None:
    """Which of the private Ray's raylet and GCS this process started has ended, or None
    (also when there is no private Ray, or it cannot be told)."""
    for pid, name in _PRIVATE_DAEMONS.items():
        st = _stat(pid)
        if st is None or st[1] in ("Z", "X") or st[0] != name:
            return name
    return None


def _use_token(token: str) -> None:
    # Read by this process's Ray and inherited by every Ray process it starts.
    os.environ[AUTH_TOKEN_ENV] = token
    os.environ.pop(AUTH_TOKEN_PATH_ENV, None)
    _set_token_mode()


def _set_token_mode() -> None:
    os.environ[AUTH_MODE_ENV] = "token"
    import sys  # noqa: PLC0415

    if "ray" in sys.modules:
        # Ray caches its configuration and the token it loaded; make it see these.
        from ray._raylet import (  # type: ignore[attr-defined]  # noqa: PLC0415
            AuthenticationTokenLoader,
            Config,
        )

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


def disconnect(conn: Connection | None, *, keep_logs_in: str | None = None) -> None:
    """Leave Ray; a private one is stopped and its directory removed, its logs kept in the run
    directory `keep_logs_in` first where one is given (`rundir.ray_logs`)."""
    import ray  # noqa: PLC0415

    if conn is not None and conn.mode == "attached":
        return  # the caller's connection: theirs to close
    _PRIVATE_DAEMONS.clear()  # stopped on purpose below: not a Ray that went away
    _PRIVATE_TEMP.clear()
    if ray.is_initialized():
        ray.shutdown()
    if conn is not None and conn.temp_dir:
        if keep_logs_in is not None:
            keep_logs(conn.temp_dir, keep_logs_in)
        shutil.rmtree(conn.temp_dir, ignore_errors=True)
        _stand_down()
