"""The policy in force on a running job, and its notification sinks: swapped whole, or refused.

A new policy comes from `remedy policy apply` (the supervisor's
`apply_policy` call) or from the policy file saved over (`PolicyWatch`, polled
by the supervisor's loop). Its bytes are untrusted (`policy_source`): a
policy that loads is swapped into the engine atomically, with new sinks if
it names other ones; one that does not is refused, its errors journaled, and
the policy in force stays. Either way `history.jsonl` says what happened.
"""

from __future__ import annotations

import threading
from pathlib import Path

import structlog

from remedy.policies import Engine, Policy, PolicyError
from remedy.protocol.spec import RunSpec
from remedy.rundir.writer import RunDir
from remedy.supervisor.notify import NOTIFICATIONS_FILE, Notifier, env_sinks
from remedy.supervisor.policy_source import PolicyWatch, is_policy_file, policy_from_bytes

log = structlog.get_logger("remedy.supervisor")

# A refused policy's errors journaled (and returned) at most; the count is logged in full.
MAX_REFUSAL_LINES = 50


class PolicyApplier:
    """Applies new policies to the run's engine, and owns the notifier of the policy in force."""

    def __init__(self, spec: RunSpec, run_dir: RunDir, engine: Engine, policy: Policy) -> None:
        self.spec = spec
        self.run_dir = run_dir
        self.engine = engine
        self.notifier = self._notifier(policy)
        # A policy given as a file is watched: saving it applies it to the running job.
        self.watched = PolicyWatch(Path(spec.policy)) if is_policy_file(spec.policy) else None

    def _notifier(self, policy: Policy) -> Notifier:
        """The policy's sinks, plus `REMEDY_NOTIFY_WEBHOOK` from `remedy run`'s environment."""
        self.sinks = policy.notify
        return Notifier(
            [*policy.notify, *env_sinks(self.spec.notify_env)],
            run_id=self.spec.run_id,
            env=self.spec.notify_env,
            journal=self.run_dir.path / NOTIFICATIONS_FILE,
        )

    def apply(self, data: bytes | str, filename: str) -> list[str]:
        """Validate `data` and swap it in; its errors (the old policy kept) or []."""
        try:
            policy = policy_from_bytes(data, filename)
        except PolicyError as exc:
            return self.refuse(filename, exc)
        old = self.engine.policy.name
        self.engine.reload(policy)
        if policy.notify != self.sinks:
            # The old sinks finish what they hold in the background; new notifies go to the new.
            previous, self.notifier = self.notifier, self._notifier(policy)
            threading.Thread(target=previous.close, daemon=True).start()
        self.run_dir.history(
            {"type": "policy_reloaded", "file": filename, "from": old, "to": policy.name}
        )
        log.warning("policy_reloaded", file=filename, name=policy.name)
        return []

    def poll(self) -> None:
        """Apply the watched policy file if it was saved since the last look."""
        if self.watched is None:
            return
        try:
            saved = self.watched.poll()
        except PolicyError as exc:
            # Unreadable now (replaced by a folder, permissions): refuse, keep the old policy.
            self.refuse(str(self.watched.path), exc)
            return
        if saved is not None:
            self.apply(*saved)

    def refuse(self, filename: str, exc: PolicyError) -> list[str]:
        """Journal a refused policy (the one in force stays); its error lines, capped."""
        errors = [d.format() for d in exc.diagnostics][:MAX_REFUSAL_LINES]
        log.warning("policy_refused", file=filename, errors=len(exc.diagnostics))
        self.run_dir.history(
            {
                "type": "policy_refused",
                "file": filename,
                "kept": self.engine.policy.name,
                "errors": errors,
            }
        )
        return errors
