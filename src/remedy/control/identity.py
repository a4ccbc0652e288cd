"""Whether a supervisor is new, and which incarnation it is: from every place that remembers.

journal.wal alone is not enough: a run whose journal was deleted (or replaced
by an older copy) while its ranks trained on would otherwise be taken for a
new one, and its supervisor would give out decision ids the ranks have seen.
The run is remembered in four places, and a supervisor takes the highest
count any of them gives:

- the journal's newest state record (`RunRecord.incarnation`);
- the run directory's claim (`rundir.claim`), where each supervisor notes
  its incarnation as it starts;
- the decision ids already given (decisions.jsonl, and the ids the ranks say
  they applied), each of which names the incarnation that gave it
  (`RUN-dNNNNN`: 1, `RUN-sK-dNNNNN`: K);
- Ray, which says whether this actor was restarted.

A decision id carries its incarnation, so ids of an incarnation above every
one seen are new to every rank, whatever file was lost. Pure: the shell
reads the sources and hands them in.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from remedy.control.sections import GroupSection

_ID = re.compile(r"-(?:s(?P<inc>\d+)-)?d(?P<seq>\d+)$")


def id_incarnation(decision_id: Any) -> int | None:
    """The supervisor incarnation that gave `decision_id` (None: not a decision id)."""
    if not isinstance(decision_id, str):
        return None
    m = _ID.search(decision_id)
    if m is None:
        return None
    return int(m["inc"]) if m["inc"] is not None else 1


@dataclass(frozen=True)
class Lineage:
    """What each source says about the supervisors of a run before this one."""

    journal_lives: int = 0  # the newest state record's incarnation (0: none)
    claim_lives: int = 0  # the highest incarnation noted in the claim (0: none)
    history_lives: int = 0  # the highest incarnation history.jsonl says started
    seen_ids: tuple[str, ...] = ()  # decision ids given so far, wherever found
    restarted: bool = False  # Ray restarted this actor: at least one lived before
    rank_ids: tuple[str, ...] = ()  # the ids the ranks say they applied

    @property
    def id_lives(self) -> int:
        """The highest incarnation that gave an id any source holds."""
        found = (id_incarnation(i) for i in (*self.seen_ids, *self.rank_ids))
        return max((n for n in found if n is not None), default=0)

    @property
    def lives(self) -> int:
        """Supervisors of this run before this one: the highest count of any source."""
        return max(
            self.journal_lives,
            self.claim_lives,
            self.history_lives,
            self.id_lives,
            int(self.restarted),
        )

    @property
    def incarnation(self) -> int:
        """This supervisor's incarnation: above every one any source remembers."""
        return self.lives + 1

    @property
    def journal_lost(self) -> bool:
        """Another source remembers more supervisors than the journal does: it was lost or
        replaced by an older copy, and what it holds is not the whole run."""
        return self.lives > self.journal_lives

    def sources(self) -> dict[str, int]:
        """Each source's count, for the journal."""
        return {
            "journal": self.journal_lives,
            "claim": self.claim_lives,
            "history": self.history_lives,
            "decision_ids": self.id_lives,
            "ray_restarted": int(self.restarted),
        }


def with_rank_ids(lineage: Lineage, ids: Iterable[str]) -> Lineage:
    """`lineage` with the decision ids the ranks said they applied."""
    return dataclasses.replace(lineage, rank_ids=tuple(sorted({*lineage.rank_ids, *ids})))


@dataclass(frozen=True)
class RankResume:
    """What the ranks told a supervisor that lost its journal: enough to take them over.

    `names`: rank -> its actor's name; `incarnations`: rank -> its process's
    incarnation; `generation`: the process group they all train in;
    `last_seq`: rank -> the highest report number answered (the next are
    taken); `command_seq`: the highest command seq any rank holds (new
    commands go above it, or ranks would take them as agreed already);
    `steps`: rank -> its step.
    """

    names: dict[int, str]
    incarnations: dict[int, int]
    generation: int
    last_seq: dict[int, int]
    command_seq: int
    steps: dict[int, int]

    def group_section(self) -> GroupSection:
        """The worker group's section of the record (`WorkerGroup.section`) these ranks make."""
        return GroupSection(self.generation, dict(sorted(self.names.items())))


def plan_resume(
    world_size: int, answers: Mapping[int, tuple[str, Mapping[str, Any]]]
) -> RankResume | None:
    """How to take over the ranks from their answers (rank -> (actor name, `identity()`)), or
    None where they cannot be taken over as they are: a rank missing or not yet training in
    a group, or ranks in different generations (a regroup under way). Then the group starts
    over, as for a supervisor that died while starting it."""
    if sorted(answers) != list(range(world_size)):
        return None
    names: dict[int, str] = {}
    incarnations: dict[int, int] = {}
    last_seq: dict[int, int] = {}
    steps: dict[int, int] = {}
    generations: set[int] = set()
    command_seq = 0
    for rank, (name, a) in answers.items():
        gen, inc, unanswered = a.get("generation"), a.get("incarnation"), a.get("unanswered_from")
        if not a.get("training") or "applied" not in a or a.get("run_id") is None:
            return None
        if type(gen) is not int or type(inc) is not int or type(unanswered) is not int:
            return None
        generations.add(gen)
        names[rank], incarnations[rank] = name, inc
        last_seq[rank] = max(unanswered - 1, 0)
        steps[rank] = int(a.get("step") or 0)
        command_seq = max(command_seq, int(a.get("max_seq") or 0))
    if len(generations) != 1:
        return None
    return RankResume(names, incarnations, generations.pop(), last_seq, command_seq, steps)


def journal_behind(journal_seq: int, answers: Mapping[int, tuple[str, Mapping[str, Any]]]) -> bool:
    """A rank holds a command newer than the journal's newest (`journal_seq`): the journal
    is an older copy than the run."""
    held = (a.get("max_seq") for _, a in answers.values())
    return any(type(s) is int and s > journal_seq for s in held)
