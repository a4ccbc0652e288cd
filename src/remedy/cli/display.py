"""Showing a run as it goes: a live rich display on a terminal, JSON lines elsewhere.

Both displays take the supervisor's feed events (see `remedy.supervisor.feed`)
one at a time and know nothing of Ray, so anything that can poll a
supervisor (`remedy run`, a future `remedy attach`) can drive them.

- `LiveDisplay` (a terminal): a progress bar with step / total and ETA, a
  line of numbers (loss, samples/s, LR, loss scale), each rank's state, and
  above it, as they happen, one line per decision and the ranks' own
  output prefixed `[rank N]`.
- `JsonLinesDisplay` (no terminal, `--quiet`, `ray job logs`): one JSON
  object per line per event; progress at most every `PROGRESS_EVERY_S`.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import Counter
from typing import Any, Protocol, TextIO

PROGRESS_EVERY_S = 5.0


class Display(Protocol):
    def handle(self, event: dict[str, Any]) -> None:
        """Show one feed event."""
        ...

    def close(
        self, summary: dict[str, Any], text: str, report: dict[str, str] | None = None
    ) -> None:
        """The run ended: show its summary (`text` is the human form) and where its report is."""
        ...


def make_display(*, quiet: bool = False, stream: TextIO | None = None) -> Display:
    """A live display on a terminal unless `quiet`; JSON lines otherwise."""
    out = stream if stream is not None else sys.stdout
    if not quiet and out.isatty():
        return LiveDisplay(out)
    return JsonLinesDisplay(out)


def _num(value: Any, fmt: str) -> str:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return format(value, fmt) if math.isfinite(value) else str(value)
    return "-" if value is None else str(value)


def decision_line(d: dict[str, Any]) -> str:
    """One line for one decision, as the live display shows it."""
    detail = f" — {d['detail']}" if d.get("detail") else ""
    return (
        f"step {d.get('step')}: {d.get('rule')} -> {d.get('action')} [{d.get('outcome')}]{detail}"
    )


def stats_line(p: dict[str, Any]) -> str:
    """The numbers under the progress bar."""
    parts = [
        f"loss {_num(p.get('loss'), '.4f')}",
        f"{_num(p.get('samples_per_s'), '.0f')} samples/s",
        f"lr {_num(p.get('lr'), '.3g')}",
    ]
    if p.get("loss_scale") is not None:
        parts.append(f"loss scale {_num(p.get('loss_scale'), '.0f')}")
    acts = ", ".join(f"{k}×{v}" for k, v in sorted((p.get("actions") or {}).items()))
    parts.append(f"actions: {acts or 'none'}")
    return "  ".join(parts)


def outage_line(note: dict[str, Any]) -> str:
    """One line for a supervisor outage that ended, as the displays and `remedy status` say it."""
    return (
        f"the supervisor answered again after {_num(note.get('duration_s'), '.1f')} s "
        f"without an answer ({note.get('how') or 'answered again on its own'})"
    )


# Up to this many ranks, the ranks line names each one's state; beyond, it counts them.
RANKS_LISTED = 16


def ranks_line(p: dict[str, Any]) -> str:
    """Each rank's state; with more than `RANKS_LISTED` ranks, how many are in each state,
    and which ranks are not in the most common one (the first `RANKS_LISTED` of them)."""
    ranks = p.get("ranks") or {}
    if len(ranks) <= RANKS_LISTED:
        return "ranks: " + "  ".join(f"{r}:{state}" for r, state in ranks.items())
    kind_of = {r: str(state).split()[0] for r, state in ranks.items()}  # "quiet 12s": quiet
    kinds = Counter(kind_of.values())
    common = kinds.most_common(1)[0][0]
    odd = [(r, s) for r, s in ranks.items() if kind_of[r] != common]
    counts = "; ".join(f"{n:,} {kind}" for kind, n in kinds.most_common())
    listed = ", ".join(f"{r}:{s}" for r, s in odd[:RANKS_LISTED])
    more = f", +{len(odd) - RANKS_LISTED:,} more" if len(odd) > RANKS_LISTED else ""
    return f"ranks: {counts}" + (f" ({listed}{more})" if odd else "")


class JsonLinesDisplay:
    """One JSON object per line: every event, progress throttled, the summary last."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self._last_progress = 0.0

    def _emit(self, obj: dict[str, Any]) -> None:
        self.out.write(json.dumps(obj, default=str) + "\n")
        self.out.flush()

    def handle(self, event: dict[str, Any]) -> None:
        if event.get("event") == "progress":
            now = time.monotonic()
            if now - self._last_progress < PROGRESS_EVERY_S:
                return
            self._last_progress = now
        self._emit({k: v for k, v in event.items() if k != "seq"})

    def close(
        self, summary: dict[str, Any], text: str, report: dict[str, str] | None = None
    ) -> None:
        if report:
            self._emit({"event": "report", **report})
        self._emit({"event": "summary", **summary})


class LiveDisplay:
    """A rich live display on a terminal."""

    def __init__(self, out: TextIO) -> None:
        # rich is imported here so JSON mode (CI, Ray jobs) never pays for it.
        from rich.console import Console, Group  # noqa: PLC0415
        from rich.live import Live  # noqa: PLC0415
        from rich.progress import (  # noqa: PLC0415
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.text import Text  # noqa: PLC0415

        self._text = Text
        self.console = Console(file=out, force_terminal=True, highlight=False)
        self.progress = Progress(
            TextColumn("[bold]step"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
        )
        self.task = self.progress.add_task("train", total=None)
        self.stats = Text("starting")
        self.ranks = Text("")
        self.live = Live(
            Group(self.progress, self.stats, self.ranks),
            console=self.console,
            refresh_per_second=4,
            transient=False,
        )
        self.live.start()

    def handle(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "output":
            style = "red" if event.get("stream") == "stderr" else ""
            line = self._text(f"[rank {event.get('rank')}] ", style="cyan")
            line.append(str(event.get("line", "")), style=style)
            self.console.print(line)
        elif kind == "decision":
            style = "yellow" if event.get("outcome") == "suppressed" else "bold magenta"
            self.console.print(self._text("remedy: " + decision_line(event), style=style))
        elif kind == "missed":
            self.console.print(f"remedy: ({event.get('count')} earlier events not shown)")
        elif kind == "supervisor_silent":
            how = f" ({event['how']})" if event.get("how") else ""
            self.stats.plain = f"supervisor not answering for {event.get('seconds')} s{how}"
        elif kind == "supervisor_back":
            self.console.print(self._text("remedy: " + outage_line(event), style="bold yellow"))
        elif kind == "progress":
            total = event.get("total")
            self.progress.update(self.task, completed=event.get("step") or 0, total=total)
            self.stats.plain = stats_line(event)
            self.ranks.plain = ranks_line(event)

    def close(
        self, summary: dict[str, Any], text: str, report: dict[str, str] | None = None
    ) -> None:
        self.live.stop()
        self.console.print(text, highlight=False, markup=False)
        report = report or {}
        if "html" in report:
            self.console.print(f"report: {report['html']}", highlight=False, markup=False)
        elif "error" in report:
            self.console.print(report["error"], highlight=False, markup=False)
