"""Which commands a framework's ranks apply at a step boundary; under a launcher, decided once.

Several ranks of a framework's loop (Lightning's or Hugging Face's DDP) apply
the same commands at the same boundary, or their step counts and collectives
part ways. At each boundary every rank agrees on the highest command seq that
every rank holds, with the Guard's own `Agreement` (one all-reduce; the
callbacks have no step sync of their own to fold it into, so they wait for it
at once).

Under torchrun, srun or any process group without a remedy supervisor, the
ranks also decide once for the group, the way the Guard does
(`rank.link.group_decide`): rank 0 holds the one controller, the same
all-reduce carries whether any rank has news (an anomaly, an outcome), and
only then do the ranks exchange their reports and rank 0's commands. The
commands an exchange brought are agreed again at once, so every rank applies
them at this boundary. A collective that fails there (a peer died or hung
past `REMEDY_COLLECTIVE_TIMEOUT_S`) ends the rank with one sentence saying so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from remedy.rank.link import group_decide
from remedy.rank.link.group_decide import GroupReporter
from remedy.rank.link.inbox import Agreement

if TYPE_CHECKING:
    from remedy.protocol.commands import Command
    from remedy.rank.link.context import Reporter, WorkerContext
    from remedy.rank.link.inbox import CommandInbox


def agreement_group() -> tuple[Any, torch.device]:
    """The process group every rank agrees through on which commands are due (None for one
    rank), and the device its collectives use."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None, torch.device("cpu")
    if dist.get_backend() == "nccl":
        return dist.group.WORLD, torch.device("cuda", torch.cuda.current_device())
    return dist.group.WORLD, torch.device("cpu")


@dataclass(frozen=True)
class _Joined:
    """What `group_decide.join` reads of a rank joining its launcher's group."""

    ctx: WorkerContext
    rank: int
    agreement: Agreement | None


class LoopAgreement:
    """The commands due at a framework loop's boundary, the same on every rank of its group."""

    def __init__(self, ctx: WorkerContext | None, reporter: Reporter, rank: int) -> None:
        group, device = agreement_group()
        self.agreement = Agreement(group, device) if group is not None else None
        self.reporter = reporter
        self.ctx = ctx
        # No supervisor: rank 0 decides for the group, the others send it their news.
        self.deciding = isinstance(reporter, GroupReporter)
        if self.deciding and ctx is not None:
            group_decide.join(_Joined(ctx, rank, self.agreement))

    def due(self, inbox: CommandInbox, *, tick: int, target: Any) -> list[Command]:
        """The commands to apply at this boundary. `target`: the loop's guard, named in the
        sentence a rank ends with when a peer is lost under a launcher."""
        if self.agreement is None:
            return inbox.due_at_tick(tick)
        try:
            seq = self._agree(inbox)
            if self.agreement.news:  # a rank has news for rank 0: exchange, then agree anew
                assert isinstance(self.reporter, GroupReporter)
                inbox.take(self.reporter.exchange())
                seq = self._agree(inbox)
        except RuntimeError as exc:
            membership = self.ctx.membership if self.ctx is not None else None
            if self.deciding and membership is not None:
                membership.recover(target, exc, in_step=False)  # raises, naming the cause
            raise
        return inbox.due_up_to_seq(seq)

    def _agree(self, inbox: CommandInbox) -> int:
        assert self.agreement is not None
        news = bool(getattr(self.reporter, "has_news", False)) if self.deciding else False
        self.agreement.launch(inbox.max_seq, news=news)
        seq = self.agreement.agreed(inbox.max_seq)
        assert seq is not None  # launched just now: read here
        return seq
