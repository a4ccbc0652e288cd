"""The ranks' last boundary: they end only once nothing decided on their steps is still owed.

A decision on a step the ranks trained can reach them after their last step:
a loss spike's rollback held back behind a rank restart is taken only once the
restart is applied, seconds later; a chain's next command only once the
previous one's outcome is in. A run whose ranks returned from their loop then
could apply none of it (the journal said the rollback failed, "the run ended
before the ranks reported an outcome", and the spike's update stayed in the
final weights). So at the boundary after the last step every rank holds, as
at a flagged step (`flag_hold`), reporting every `RESEND_S` with `holding`
set to the last tick it trained and `final`, and applying the commands every
rank holds, until:

- a reply says the supervisor owes nothing on those steps
  (`control.end_check.may_end`): the ranks end;
- a command applied there sent the ranks back (a rollback): they train again
  and come to their last boundary again later;
- the supervisor is lost for good (`supervisor.liveness` gave up on it), or
  one rank has waited `END_WAIT_S` (a supervisor that stopped answering):
  they end, as before, and what was still pending is journaled failed.

Ranks leave together (`agree_while_holding`). Without a supervisor that says
what is settled (a Guard alone, or a group whose rank 0 decides), nothing is
owed across processes and nothing is held. What it costs a run that owes
nothing: one report round trip at its end.
"""

from __future__ import annotations

from typing import Any

# Longest hold at the last boundary (GuardConfig.end_wait_s): a rank restart under way
# when the ranks reach it takes seconds, tens on a loaded machine.
END_WAIT_S = 120.0


def released(guard: Any, settled: int, last: int) -> bool:
    """Whether this rank may leave its hold at the last boundary: the supervisor settled
    the last tick trained, a command sent the loop back or stopped it, or the supervisor is
    lost for good."""
    if settled >= last or guard.stopped is not None:
        return True
    if guard.max_steps is not None and guard.step_count < guard.max_steps:
        return True
    return getattr(guard.reporter, "supervisor_lost", None) is not None
