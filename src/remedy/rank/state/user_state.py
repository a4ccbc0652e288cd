"""The loop's own state: the user's `Stateful` objects, kept with the model through every recovery.

A loop keeps state the Guard cannot see: a counter, `best_val_loss`, an EMA
of the weights, a data loader's position, a sampler. The user hands such
objects to the Guard (`Guard(..., state={"name": obj})` or
`guard.register_state(name, obj, per_rank=...)`), each with `state_dict()`
and `load_state_dict()` (torch's `Stateful` protocol, as DCP and torchtitan's
checkpointer take them). Their states are captured into every snapshot (so
a rollback restores them and every durable or DCP checkpoint holds them),
and loaded back wherever the model's state is.

Two kinds, because a replacement rank must take each from the right place:

- replicated (the default): the same on every data-parallel rank (a loop
  counter, an EMA of replicated weights). A replacement adopts it from the
  survivor whose model state it adopts, in the same broadcast.
- per rank (`per_rank=True`): each rank's own (the rank-0-only
  `best_val_loss` of an eval that only rank 0 runs, a per-rank sampler).
  A rollback or a resume loads the rank's own copy; in a re-formed group
  each survivor keeps its own; a replacement takes its rank's copy from the
  newest durable checkpoint that rank wrote at or before the adopted step
  (the only copy that outlived its process), else keeps what its own
  construction gave it.

The data source given as `data=` is per rank too, and is not registered
here: the data cursor keeps its state (`data.BatchCursor`), and a
replacement's fresh source reads up to the adopted position.

Loading is all or nothing: if one `load_state_dict` raises, those loaded
before it are put back, and `UserStateError` (an `ActionError`) says which
and why, so a rollback fails with the reason and nothing is lost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog

from remedy.rank.exceptions import GuardConfigError, UserStateError
from remedy.rank.state.snapshots import clone_to_host

log = structlog.get_logger("remedy.user_state")


@dataclass
class _Entry:
    obj: Any
    per_rank: bool


def check_stateful(name: str, obj: Any) -> None:
    """Raise `GuardConfigError` naming `name` unless `obj` has `state_dict` and `load_state_dict`."""
    if not isinstance(name, str) or not name:
        raise GuardConfigError(f"state: every key must be a non-empty string, got {name!r}")
    missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))]
    if missing:
        kind = type(obj).__name__
        article = "an" if kind[:1].lower() in "aeiou" else "a"
        raise GuardConfigError(
            f"state[{name!r}]: {article} {kind} has no {' or '.join(f'{m}()' for m in missing)}"
            "; give an object with state_dict() and load_state_dict() (torch's Stateful protocol)"
        )


class UserState:
    """The user's registered objects, by name; see the module docstring."""

    def __init__(self, objects: dict[str, Any] | None = None) -> None:
        self._entries: dict[str, _Entry] = {}
        if objects is not None and not isinstance(objects, dict):
            raise GuardConfigError(
                f"state: expected a dict of name -> Stateful object, got {type(objects).__name__}"
            )
        for name, obj in (objects or {}).items():
            self.register(name, obj)

    def register(self, name: str, obj: Any, *, per_rank: bool = False) -> None:
        """Add (or replace) `name`; checked at once."""
        check_stateful(name, obj)
        self._entries[name] = _Entry(obj, per_rank)

    def names(self, *, per_rank: bool | None = None) -> list[str]:
        """The registered names (all, or only those per rank / only the replicated)."""
        return [n for n, e in self._entries.items() if per_rank is None or e.per_rank == per_rank]

    def __len__(self) -> int:
        return len(self._entries)

    def capture(self) -> dict[str, Any]:
        """A host copy of every object's `state_dict()`, by name."""
        return {n: clone_to_host(e.obj.state_dict()) for n, e in self._entries.items()}

    def load(self, saved: dict[str, Any], *, names: list[str] | None = None) -> list[str]:
        """Load `saved[name]` into each object (of `names`, default all) present in `saved`.

        All or nothing: when one raises, those already loaded are given back their
        state from before, and `UserStateError` names the one that failed. Objects
        registered after `saved` was captured keep what they have. Returns the names
        loaded.
        """
        wanted = self.names() if names is None else names
        todo = [n for n in wanted if n in saved and n in self._entries]
        before: dict[str, Any] = {}
        for name in todo:
            entry = self._entries[name]
            before[name] = clone_to_host(entry.obj.state_dict())
            try:
                # A copy: the object may keep what it is given, and the snapshot must stay as is.
                entry.obj.load_state_dict(clone_to_host(saved[name]))
            except Exception as exc:
                self._put_back(before)
                raise UserStateError(
                    f"state {name!r}: load_state_dict raised {type(exc).__name__}: {exc}"
                ) from exc
        return todo

    def _put_back(self, before: dict[str, Any]) -> None:
        """Give each object its state from before (the failed one too: it may be half loaded)."""
        for name, state in before.items():
            try:
                self._entries[name].obj.load_state_dict(state)
            except Exception as exc:  # the user's object cannot take its own state back
                log.error("user_state_not_restored", name=name, error=repr(exc))
