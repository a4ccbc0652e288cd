"""The run's token on every call into the supervisor: refusals counted and journaled, sparsely.

Every call carries the run's token (`RunSpec.token`); a call without it (a
foreign batch, another run's CLI) is refused, counted in the controller's
`rejected["token"]`, and journaled on its 1st, 10th, 100th, ... refusal of
each call, so a flood of foreign batches does not flood the journal too.
"""

from __future__ import annotations

import secrets
from typing import Any

import structlog

from remedy.control.run_core import RunCore
from remedy.protocol.exceptions import Unauthorized
from remedy.rundir.writer import RunDir

log = structlog.get_logger("remedy.supervisor")


class TokenCheck:
    """Checks a call's token against the run's; counts and journals the refusals."""

    def __init__(self, token: str, run_id: str, core: RunCore, run_dir: RunDir) -> None:
        self._token = token.encode()
        self.run_id = run_id
        self.core = core
        self.run_dir = run_dir
        self._refusals: dict[str, int] = {}  # refused calls by method, for the journal
        self._journaled: dict[str, int] = {}

    def ok(self, token: Any, call: str = "call") -> bool:
        """True for this run's token; a refusal is counted in `rejected["token"]` and journaled."""
        if isinstance(token, str) and secrets.compare_digest(
            token.encode("utf-8", "replace"), self._token
        ):
            return True
        # The controller's counter, read now: a restore replaces it.
        self.core.controller.rejected["token"] += 1
        self._refusals[call] = count = self._refusals.get(call, 0) + 1
        if count >= self._journaled.get(call, 0) * 10:
            self._journaled[call] = max(count, 1)
            log.warning("call_refused", call=call, reason="token", count=count)
            self.run_dir.history(
                {"type": "refused", "call": call, "reason": "token", "count": count}
            )
        return False

    def require(self, token: Any, call: str) -> None:
        """Raise `Unauthorized` unless `token` is this run's."""
        if not self.ok(token, call):
            raise Unauthorized(f"{call} refused: not run {self.run_id}'s token")
