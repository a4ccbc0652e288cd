"""`remedy report`: a run's timeline as a PNG and a self-contained HTML page.

The figure has one panel per measure (loss, gradient norm, LR, loss scale,
memory, step time) over the logical step. Each stretch of training between
rollbacks is its own line; steps later undone by a rollback are drawn faint
and dashed, and the rollback itself is an arrow back to the step it
restored, with the steps whose batches were skipped shaded. Anomalies are
marked on the loss panel, LR cuts and scaler rescues annotated on their
panels, rank restarts drawn as markers on every panel. A supervisor outage
is a grey band over the steps the ranks trained while it did not answer
(from the last step it wrote before the outage to the newest step of the
first reports it wrote after).
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never a window

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.text import Annotation

from remedy.rundir.headline import steps_asked, steps_words
from remedy.rundir.rundata import RunData, load_run, number, status_line

PANELS: list[tuple[str, str, float]] = [
    # (metrics key, panel title, scale applied to the value)
    ("loss", "loss", 1.0),
    ("grad_norm", "grad norm", 1.0),
    ("lr", "learning rate", 1.0),
    ("loss_scale", "loss scale", 1.0),
    ("mem_bytes", "memory (MiB)", 1.0 / 2**20),
    ("step_time_s", "step time (ms)", 1000.0),
]
KIND_COLORS = ["#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf", "#ff7f0e"]


def write_report(
    run_dir: str | Path | RunData, out_dir: str | Path | None = None
) -> tuple[Path, Path]:
    """Render `report.png` and `report.html` for the run in `run_dir` (into `out_dir`, default the run dir).

    `run_dir` may be the run already read (`load_run`), so a caller that printed
    its summary does not read the journals a second time.
    """
    run = run_dir if isinstance(run_dir, RunData) else load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run.path
    out.mkdir(parents=True, exist_ok=True)
    fig = timeline(run)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    png = out / "report.png"
    png.write_bytes(buf.getvalue())
    page = out / "report.html"
    page.write_text(render_html(run, buf.getvalue()), encoding="utf-8")
    return png, page


# ------------------------------------------------------------------ figure
def _segments(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Split one rank's records (in tick order) where the step goes back: one list per stretch."""
    out: list[list[dict[str, Any]]] = []
    for row in rows:
        if not out or int(row["step"]) <= int(out[-1][-1]["step"]):
            out.append([])
        out[-1].append(row)
    return out


def _panels(run: RunData) -> list[tuple[str, str, float]]:
    """The panels that have data in this run (a run without a GradScaler has no loss scale)."""
    return [
        p for p in PANELS if any(number(m.get(p[0])) is not None for m in run.metrics)
    ] or PANELS[:1]


def _ranks_differ(run: RunData, key: str) -> bool:
    by_rank: dict[int, list[float | None]] = {}
    for r in run.ranks():
        by_rank[r] = [number(m.get(key)) for m in run.metrics_of(r)]
    first = next(iter(by_rank.values()), [])
    return any(v != first for v in by_rank.values())


def _draw_series(ax: Axes, run: RunData, key: str, scale: float) -> None:
    ranks = run.ranks() if _ranks_differ(run, key) else run.ranks()[:1]
    for i, rank in enumerate(ranks):
        color = f"C{i}"
        segs = _segments(run.metrics_of(rank))
        for k, seg in enumerate(segs):
            # Steps at or past where the next stretch starts were undone by a rollback.
            undone_from = int(segs[k + 1][0]["step"]) if k + 1 < len(segs) else math.inf
            kept = [m for m in seg if int(m["step"]) <= undone_from]
            undone = [m for m in seg if int(m["step"]) >= undone_from]
            label = f"rank {rank}" if len(ranks) > 1 and k == 0 else None
            _line(ax, kept, key, scale, color=color, label=label)
            _line(ax, undone, key, scale, color=color, alpha=0.35, linestyle="--")


def _line(ax: Axes, rows: Sequence[dict[str, Any]], key: str, scale: float, **style: Any) -> None:
    xs, ys = [], []
    for m in rows:
        v = number(m.get(key))
        xs.append(int(m["step"]))
        ys.append(v * scale if v is not None and math.isfinite(v) else math.nan)
    if xs:
        ax.plot(xs, ys, linewidth=1.1, **style)


def _value_at(run: RunData, key: str, step: int, tick: int | None, rank: int = 0) -> float | None:
    """The metric a rank recorded at `tick` (or, without one, the last at `step`), finite only."""
    rows = run.metrics_of(rank) or run.metrics
    match = [m for m in rows if tick is not None and m.get("tick") == tick] or [
        m for m in rows if m.get("step") == step
    ]
    for m in reversed(match):
        v = number(m.get(key))
        if v is not None and math.isfinite(v):
            return v
    return None


def timeline(run: RunData) -> Figure:
    """The run's timeline figure (see the module docstring for how to read it)."""
    panels = _panels(run)
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(10, 1.7 * len(panels) + 0.8), sharex=True, squeeze=False
    )
    axs = {key: ax for (key, _, _), ax in zip(panels, axes[:, 0], strict=True)}
    for (key, title, scale), ax in zip(panels, axes[:, 0], strict=True):
        _draw_series(ax, run, key, scale)
        ax.set_ylabel(title, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.25)
        if key == "loss_scale" or (key in ("grad_norm", "loss") and _wide(run, key)):
            ax.set_yscale("log")
    loss_ax = axs.get("loss", axes[0, 0])
    _mark_anomalies(loss_ax, run)
    _mark_actions(run, axs, loss_ax, list(axes[:, 0]))
    _mark_outages(run, loss_ax, list(axes[:, 0]))
    axes[-1, 0].set_xlabel("step", fontsize=8)
    s = run.summary
    fig.suptitle(
        f"run {s.get('run_id')}: {status_line(run).split(' (')[0]}, "
        f"{steps_words(s)}, "
        f"goodput {float(s.get('goodput') or 0):.1%}"
        + (f", ETTR {float(s['ettr']):.1%}" if s.get("ettr") is not None else ""),
        fontsize=10,
        y=0.995,
    )
    handles, labels = loss_ax.get_legend_handles_labels()
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    for ax in axes[:, 0]:
        _spread_labels(fig, ax)
    if handles:
        # Above the panels, where it hides no mark.
        fig.legend(handles, labels, fontsize=7, loc="upper center", ncol=6,
                   bbox_to_anchor=(0.5, 0.965), frameon=False)  # fmt: skip
    return fig


def _spread_labels(fig: Figure, ax: Axes) -> None:
    """Move the action labels of one panel apart where they would overlap (two actions on
    the same step): each is shifted past the ones placed before it, down for a level label,
    right for an upright one."""
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    placed: list[Any] = []
    for text in ax.texts:
        if not text.get_text() or not isinstance(text, Annotation):
            continue
        if text.get_anncoords() != "offset points":
            continue
        for _ in range(12):
            box = text.get_window_extent(renderer)
            hit = next((b for b in placed if box.overlaps(b)), None)
            if hit is None:
                break
            px_per_pt = fig.dpi / 72.0
            dx, dy = text.xyann
            if text.get_rotation() % 180:
                text.xyann = (dx + (hit.x1 - box.x0) / px_per_pt + 1, dy)
            else:
                text.xyann = (dx, dy - (box.y1 - hit.y0) / px_per_pt - 1)
        placed.append(text.get_window_extent(renderer))


def _wide(run: RunData, key: str) -> bool:
    vals = [v for m in run.metrics if (v := number(m.get(key))) and math.isfinite(v) and v > 0]
    return bool(vals) and max(vals) / min(vals) > 100


def _mark_anomalies(ax: Axes, run: RunData) -> None:
    kinds = sorted({str(a.get("kind")) for a in run.anomalies})
    top = ax.get_ylim()[1]
    for i, kind in enumerate(kinds):
        xs, ys = [], []
        for a in run.anomalies:
            if a.get("kind") != kind:
                continue
            step = int(a.get("step", 0))
            y = _value_at(run, "loss", step, a.get("tick"), int(a.get("rank", 0) or 0))
            xs.append(step)
            ys.append(top if y is None else y)  # a NaN loss is marked at the top
        ax.scatter(
            xs, ys, marker="X", s=46, color=KIND_COLORS[i % len(KIND_COLORS)], zorder=5, label=kind
        )


def _mark_actions(run: RunData, axs: dict[str, Axes], loss_ax: Axes, every: list[Axes]) -> None:
    for d in run.decisions:
        if d.get("outcome") != "applied":
            continue
        action, result = d.get("action"), d.get("result") or {}
        at = int(d.get("applied_at_step") or d.get("step") or 0)
        if action == "rollback" and "restored_step" in result:
            _draw_rollback(run, loss_ax, d, result)
        elif action == "shrink_lr" and "lr" in axs:
            ax = axs["lr"]
            after = (result.get("lr_after") or [None])[0]
            ax.axvline(at, color="#2ca02c", linewidth=0.8, linestyle=":")
            ax.annotate(
                f"LR ×{d.get('params', {}).get('factor')}",
                (at, after or ax.get_ylim()[0]),
                xytext=(4, 6),
                textcoords="offset points",
                fontsize=7,
                color="#2ca02c",
            )
        elif action == "rescale_grad_scaler":
            ax = axs.get("loss_scale", loss_ax)
            ax.axvline(at, color="#1f77b4", linewidth=0.8, linestyle=":")
            ax.annotate("scaler rescue", (at, ax.get_ylim()[1]), fontsize=7, color="#1f77b4",
                        xytext=(3, -10), textcoords="offset points")  # fmt: skip
        elif action == "restart_rank":
            for ax in every:
                ax.axvline(at, color="black", linewidth=0.8, linestyle="-.")
            loss_ax.plot([at], [loss_ax.get_ylim()[1]], marker="v", color="black", zorder=6)
            loss_ax.annotate(f"restart rank {','.join(map(str, d.get('ranks', [])))}",
                             (at, loss_ax.get_ylim()[1]), fontsize=7,
                             xytext=(4, -12), textcoords="offset points")  # fmt: skip
        else:
            loss_ax.axvline(at, color="grey", linewidth=0.7, linestyle=":")
            loss_ax.annotate(str(action), (at, loss_ax.get_ylim()[1]), fontsize=6, color="grey",
                             rotation=90, va="top", xytext=(2, -2), textcoords="offset points")  # fmt: skip


def outage_steps(run: RunData, outage: dict[str, Any]) -> tuple[int, int] | None:
    """The steps trained while the supervisor did not answer, as its metrics show them.

    metrics.jsonl is written by the supervisor when it takes a report: the
    last step written before the outage began, and the newest step of the
    first write after it ended (the reports the ranks held meanwhile).
    """
    began, ended = number(outage.get("began")), number(outage.get("ended"))
    if began is None or ended is None:
        return None
    before: list[tuple[float, int]] = []
    after: list[tuple[float, int]] = []
    for m in run.metrics:
        t, step = _epoch(m.get("ts")), number(m.get("step"))
        if t is not None and step is not None:
            (after if t >= ended else before).append((t, int(step)))
    if not after:
        return None
    first = min(t for t, _ in after)
    start = max((s for t, s in before if t < began), default=0)
    end = max(s for t, s in after if t == first)
    return (start, end) if end >= start else None


def _epoch(ts: Any) -> float | None:
    """A journal's ISO timestamp in seconds since the epoch (None if it is not one)."""
    import datetime  # noqa: PLC0415 - only reports with outages need it

    if not isinstance(ts, str):
        return None
    try:
        return datetime.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _mark_outages(run: RunData, loss_ax: Axes, every: list[Axes]) -> None:
    outages = run.summary.get("supervisor_outages")
    for outage in outages if isinstance(outages, list) else []:
        if not isinstance(outage, dict):
            continue
        steps = outage_steps(run, outage)
        if steps is None:
            continue
        for ax in every:
            ax.axvspan(*steps, color="#7f7f7f", alpha=0.18, linewidth=0, hatch="//")
        loss_ax.annotate(
            f"supervisor not answering {_cell(outage.get('duration_s'))} s",
            (steps[0], loss_ax.get_ylim()[0]),
            xytext=(2, 14),
            textcoords="offset points",
            fontsize=7,
            color="#555555",
        )


def _draw_rollback(run: RunData, ax: Axes, d: dict[str, Any], result: dict[str, Any]) -> None:
    restored = int(result["restored_step"])
    start = int(result.get("from_step") or d.get("applied_at_step") or d.get("step") or restored)
    lo, hi = ax.get_ylim()
    y = hi - 0.12 * (hi - lo)
    ax.annotate(
        "",
        xy=(restored, y),
        xytext=(start, y),
        arrowprops={"arrowstyle": "->", "color": "#d62728", "linewidth": 1.4},
    )
    ax.annotate(f"rollback to {restored}", (restored, y), xytext=(0, 4),
                textcoords="offset points", fontsize=7, color="#d62728")  # fmt: skip
    skipped = result.get("skipped_count", len(result.get("skipped_batches") or []))
    if isinstance(skipped, int) and skipped > 0:
        # The skipped batches are the data the replay would have trained on from the
        # restored step: shade those steps.
        ax.axvspan(restored, restored + skipped, color="#ff7f0e", alpha=0.15, linewidth=0)
        ax.annotate(f"{skipped} batches skipped", (restored, lo), xytext=(2, 3),
                    textcoords="offset points", fontsize=7, color="#c55a00")  # fmt: skip


# -------------------------------------------------------------------- HTML
def _cell(value: Any) -> str:
    if isinstance(value, float):
        return html.escape(f"{value:.4g}")
    if isinstance(value, dict | list):
        return html.escape(
            ", ".join(f"{k}={v}" for k, v in value.items())
            if isinstance(value, dict)
            else ", ".join(map(str, value))
        )
    return html.escape("" if value is None else str(value))


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str]], css: str) -> str:
    head = "".join(f"<th>{html.escape(title)}</th>" for _, title in columns)
    body = "\n".join(
        "<tr>" + "".join(f"<td>{_cell(_get(r, key))}</td>" for key, _ in columns) + "</tr>"
        for r in rows
    )
    return f'<table class="{css}"><thead><tr>{head}</tr></thead><tbody>\n{body}\n</tbody></table>'


def _get(record: dict[str, Any], key: str) -> Any:
    value: Any = record
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


DECISION_COLUMNS = [
    ("decision_id", "decision"),
    ("step", "step"),
    ("ranks", "ranks"),
    ("rule", "rule"),
    ("anomaly.kind", "anomaly"),
    ("action", "action"),
    ("params", "params"),
    ("outcome", "outcome"),
    ("applied_at_step", "applied at"),
    ("detail", "what happened"),
    ("reason", "reason"),
]
ANOMALY_COLUMNS = [
    ("step", "step"),
    ("tick", "tick"),
    ("rank", "rank"),
    ("kind", "kind"),
    ("severity", "severity"),
    ("source", "source"),
    ("value", "value"),
    ("threshold", "threshold"),
]

_CSS = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; font-size: 12px; margin-bottom: 1.5em; }
td, th { border: 1px solid #ccc; padding: 3px 6px; text-align: left; vertical-align: top; }
th { background: #f2f2f2; }
img { max-width: 100%; }
.summary td:first-child { font-weight: bold; }
"""


def _outages_text(outages: Any) -> str | None:
    """One sentence per outage (the supervisor's, or node agents'), for the summary table."""
    if not isinstance(outages, list) or not outages:
        return None
    return "; ".join(
        f"{o.get('duration_s')} s without an answer, noticed after {o.get('noticed_after_s')} s "
        f"by {', '.join(map(str, o.get('noticed_by') or []))}: {o.get('how')}"
        for o in outages
        if isinstance(o, dict)
    )


def render_html(run: RunData, png: bytes) -> str:
    """One page with everything inline: no file beside it is needed to read it."""
    s = run.summary
    facts = [
        ("run", s.get("run_id")),
        ("status", status_line(run)),
        ("abort reason", s.get("abort_reason")),
        ("steps completed", s.get("steps_completed")),
        ("steps asked", steps_asked(s)),
        ("steps executed", s.get("steps_executed")),
        ("steps kept", s.get("steps_kept")),
        ("goodput (steps kept / executed)", f"{float(s.get('goodput') or 0):.1%}"),
        (
            "ETTR (kept steps' time / wall time)",
            f"{float(s['ettr']):.1%}" if s.get("ettr") is not None else None,
        ),
        ("time lost, by cause (s)", s.get("time_lost_by_cause")),
        ("final loss (mean of the last 10)", s.get("final_loss")),
        ("ranks", s.get("workers")),
        ("wall time (s)", s.get("wall_s")),
        ("anomalies", s.get("anomalies")),
        ("actions applied", s.get("actions")),
        ("decision outcomes", s.get("outcomes")),
        ("supervisor outages", _outages_text(s.get("supervisor_outages"))),
        ("node agent outages", _outages_text(s.get("agent_outages"))),
    ]
    errors = [
        (f"rank {r.get('rank')} error", r.get("error"))
        for r in s.get("ranks", [])
        if r.get("error")
    ]
    summary_rows = "\n".join(
        f"<tr><td>{html.escape(k)}</td><td>{_cell(v)}</td></tr>"
        for k, v in [*facts, *errors]
        if v not in (None, "", {})
    )
    img = base64.b64encode(png).decode("ascii")
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>remedy report {html.escape(str(s.get("run_id")))}</title>
<style>{_CSS}</style></head><body>
<h1>remedy run {html.escape(str(s.get("run_id")))}</h1>
<table class="summary">{summary_rows}</table>
{_lost_table(s)}
<h2>Timeline</h2>
<img alt="timeline" src="data:image/png;base64,{img}">
<h2>Decisions ({len(run.decisions)})</h2>
{_table(run.decisions, DECISION_COLUMNS, "decisions")}
<h2>Anomalies ({len(run.anomalies)})</h2>
{_table(run.anomalies, ANOMALY_COLUMNS, "anomalies")}
</body></html>
"""


LOST_COLUMNS = [("what", "what"), ("cause", "cause"), ("steps", "steps"), ("seconds", "seconds")]


def _lost_table(s: dict[str, Any]) -> str:
    """Where the wall time that went to no kept step went (summary `time_lost`)."""
    rows = s.get("time_lost")
    if not isinstance(rows, list) or not rows:
        return ""
    return f"<h2>Time lost</h2>\n{_table(rows, LOST_COLUMNS, 'lost')}"
