"""Whether a group that trained every step through a tick may end: nothing about them is owed.

The ranks' last boundary waits for this (`rank.link.end_hold`): a decision on
a step they trained may still be on its way when they reach their last step.
A spike's rollback held back behind a rank restart is decided only once the
restart is applied, seconds after the anomaly; a chain's next command comes
only once the previous one's outcome is in. A run whose ranks returned from
their loop then could apply none of it: the journal said the rollback failed
("the run ended before the ranks reported an outcome") and the spike's update
stayed in the final weights. So the ranks, at their last boundary, hold until
the supervisor says that nothing more can come:

- every decision on the steps through `tick` is taken (`Controller.settled`:
  every rank reported past it, no incident of it held);
- no group action (a rank restart) is under way, and the engine holds back
  no match behind one;
- every command given out is answered by every rank it went to (an outcome
  may bring a follow-up: a failed step's escalation, a held match released).

The commands decided meanwhile reach the ranks with the replies to their
holding reports, and they apply them there: a rollback sends them back to
train again, and they come to their last boundary again later.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from remedy.control.decide import Controller


def may_end(controller: Controller, tick: int) -> bool:
    """Whether ranks that trained every step through `tick` may end: nothing decided, held
    or in flight is still owed to them."""
    c = controller
    return c.settled(tick) and not c.deferred and not c.engine.holding_back and not c.pending
