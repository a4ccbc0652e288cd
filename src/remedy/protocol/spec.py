"""What a supervised run is asked to do: the validated inputs of `remedy run`."""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import asdict, dataclass, field
from typing import Any

# The Ray namespace of every remedy actor.
NAMESPACE = "remedy"
# `RunSpec.node_agents` values (`remedy run --node-agents`).
NODE_AGENT_MODES = ("on", "off", "auto")


def supervisor_name(run_id: str) -> str:
    """The Ray actor name of a run's supervisor (in namespace `NAMESPACE`)."""
    return f"remedy-supervisor-{run_id}"


def new_run_id() -> str:
    """Sortable and unique: UTC time plus a short random suffix."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


@dataclass
class RunSpec:
    target: str
    policy: str = "default"
    workers: int = 1
    run_id: str = field(default_factory=new_run_id)
    run_dir: str = ""
    faults: list[dict[str, Any]] = field(default_factory=list)
    dry_run: bool = False
    argv: list[str] = field(default_factory=list)
    threads_per_rank: int | None = None
    gpus_per_rank: float = 0.0
    verbose: bool = False
    # Multi-rank jobs: warm spare actors kept ready to replace a lost rank
    # (None: 1 when workers > 1), the hang watch's timeouts
    # (`supervisor.core.hang_watch.HangWatchConfig` keys), and the targeted
    # restarts that may fail in a row before the whole group restarts.
    spares: int | None = None
    # Warm spares on each node that holds ranks, besides `spares` (which sit on other nodes
    # than the ranks they stand in for): a rank whose process is lost while its node lives
    # is replaced on its own node, by that node's agent where the run has agents
    # (`NodeAgent.promote`). 0: none.
    local_spares: int = 0
    hang_watch: dict[str, float] = field(default_factory=dict)
    max_targeted_restarts: int = 3
    # Chaos for the supervisor itself: it SIGKILLs its own process once at each
    # of these points of a recovery (`recovery.CRASH_POINTS`), so a test can
    # crash it in the middle of a restart; Ray restarts it and it carries on.
    crash_points: list[str] = field(default_factory=list)
    # A report or driver call unanswered this long means a hung supervisor, which is
    # then killed so that Ray restarts it (None: derived from the Guard's heartbeat,
    # `supervisor.liveness.silence_bound`, 10 s at its 0.5 s default).
    supervisor_timeout_s: float | None = None
    # The run's secret: reports, commands, `status`, `policy apply` and `stop`
    # without it are refused (see `supervisor.token_check`). Kept in the
    # registry entry (owner-only) of the machine that started the run.
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    # The environment variables notify sinks read (`REMEDY_NOTIFY_WEBHOOK` and each
    # `url_env` the policy names), as `remedy run` found them: the supervisor may run
    # on another node, whose environment does not have them. Secrets, like the token.
    notify_env: dict[str, str] = field(default_factory=dict)
    # `--resume-from`: the run every rank starts from (`resume.ResumePoint.to_dict`:
    # its run directory, the checkpoint step, how many ranks wrote it); empty for a fresh start.
    resume: dict[str, Any] = field(default_factory=dict)
    # Where ranks run on a cluster of several nodes (`supervisor.placement`): `spread`
    # round-robin over the nodes other than the supervisor's, `pack` fills each in turn.
    placement: str = "spread"
    # Node agents (`supervisor.agent`): "on" starts one per node and the ranks report to
    # their node's; "off" keeps every rank reporting to the supervisor; "auto" is on when
    # the Ray cluster has more than one node. The supervisor resolves it as it starts.
    # Off by default: node loss is measured without agents (docs/node-agents.md).
    node_agents: str = "off"

    def __post_init__(self) -> None:
        if not self.run_dir:
            self.run_dir = os.path.join("runs", self.run_id)
        self.run_dir = os.path.abspath(os.path.expanduser(self.run_dir))
        if self.placement not in ("spread", "pack"):
            raise ValueError(f"placement must be spread or pack, not {self.placement!r}")
        if self.node_agents not in NODE_AGENT_MODES:
            raise ValueError(f"node_agents must be one of {', '.join(NODE_AGENT_MODES)}")
        if self.spares is None:
            self.spares = 1 if self.workers > 1 else 0
        if self.local_spares < 0:
            raise ValueError(f"local_spares must be 0 or more, not {self.local_spares}")
        if self.threads_per_rank is None:
            # Ranks of one node share its cores; oversubscribing them makes every rank slower.
            self.threads_per_rank = max(1, (os.cpu_count() or 1) // max(self.workers, 1))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __repr__(self) -> str:
        # The token is a credential: it stays out of logs and tracebacks.
        hidden = ("token", "notify_env")
        fields = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items() if k not in hidden)
        return f"RunSpec({fields}, token=<hidden>, notify_env=<{len(self.notify_env)} hidden>)"
