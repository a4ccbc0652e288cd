"""Hypothesis throws malformed report batches at a live supervisor while it supervises a real run.

The run is a one-rank `examples/pretrain_gpt.py` job with a NaN at step
NAN_AT, slowed until then so every hostile batch lands while it trains.
Each generated batch is refused for a reason known when it is built (not a
mapping, a bad header, another run's token, a stale incarnation, a batch
sequence number seen already or absurdly far ahead, or a plausible header
whose every item is bad), so the test knows what each must add to the
rejection counts. Meanwhile it polls `events()` as a display does. The
supervisor must stay up and keep answering, count every rejection by its
family, show none of the hostile content to displays, and supervise the run
to its end exactly as without them: the NaN's rollback applied once.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import ray
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remedy.policies import ANOMALY_KINDS
from remedy.protocol.reports import Limits, RankMark, validate_batch
from remedy.protocol.spec import RunSpec
from remedy.rundir.writer import read_jsonl
from remedy.supervisor.actor import SupervisorActor
from tests.supervisor.runs import finished

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
TARGET = f"{REPO / 'examples' / 'pretrain_gpt.py'}:main"
POLICY = """
version: 1
name: nan-only
rules:
  - name: nan-rollback
    when: {anomaly: nonfinite_loss}
    do:
      - rollback: {steps_back: 10, skip_batches: 2}
"""
NAN_AT = 40
EXAMPLES = 250
OTHER_TOKEN = "f" * 32  # another run's

# ---------------------------------------------------------------- strategies
_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.just(10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=8),
)
JUNK = st.recursive(
    _LEAF,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def nested(depth: int) -> Any:
    value: Any = 1.0
    for _ in range(depth):
        value = {"d": value}
    return value


# Deeper than a record may hold values (`Limits.max_nodes`), shallower than pickle allows.
DEEP = st.integers(300, 450).map(nested)
# Not a step, tick or rank: wrong types, negative, beyond what JSON keeps exact.
BAD_COUNT = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=5),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(max_value=-1),
    st.integers(min_value=2**53),
    st.just(10**400),
    st.lists(st.integers(0, 5), max_size=2),
    DEEP,
)
# A tick may be absent (null): the event's step stands for it. Not a defect there.
BAD_TICK = BAD_COUNT.filter(lambda v: v is not None)
# "nan", "inf" and "-inf" in any case are how JSON carries non-finite values: valid.
NONFINITE_TEXT = ("nan", "inf", "-inf")
KINDS = ["nonfinite_loss", "loss_spike", "data_stall", "rank_hang", "oom"]


@st.composite
def bad_event(draw: st.DrawFn) -> Any:
    """An event with at least one defect that refuses it (valid ones would be decided)."""
    ev: dict[str, Any] = {
        "kind": draw(st.sampled_from(KINDS)),
        "rank": 0,
        "step": draw(st.integers(0, 50)),
        "value": draw(st.floats(allow_nan=True, allow_infinity=True)),
        "severity": "critical",
    }
    defect = draw(
        st.sampled_from(["kind", "rank", "step", "tick", "value", "field", "deep", "raw"])
    )
    if defect == "kind":
        # Hypothesis also draws strings it finds in the code under test: a kind's name among them.
        ev["kind"] = draw(
            st.one_of(st.text(max_size=20), JUNK).filter(lambda k: k not in ANOMALY_KINDS)
        )
    elif defect == "rank":
        ev["rank"] = draw(st.one_of(BAD_COUNT, st.integers(1, 10**6)))
    elif defect == "step":
        ev["step"] = draw(st.one_of(BAD_COUNT, st.just(10**15)))
    elif defect == "tick":
        ev["tick"] = draw(st.one_of(BAD_TICK, st.just(10**12)))
    elif defect == "value":
        text = st.text(max_size=4).filter(lambda s: s.lower() not in NONFINITE_TEXT)
        ev["value"] = draw(st.one_of(st.just(10**400), text, st.lists(_LEAF)))
    elif defect == "field":
        ev[draw(st.sampled_from(["colour", "seq", "__class__", "event"]))] = draw(JUNK)
    elif defect == "deep":
        ev["details"] = draw(DEEP)
    else:
        return draw(JUNK.filter(lambda v: not isinstance(v, dict)))
    return ev


@st.composite
def bad_metrics(draw: st.DrawFn) -> Any:
    """A metrics record that is not plain bounded data about rank 0's steps."""
    defect = draw(st.sampled_from(["step", "rank", "deep", "huge", "raw"]))
    record: dict[str, Any] = {"step": 1, "tick": 1, "loss": draw(st.floats()), "step_time_s": 0.1}
    if defect == "step":
        record["step"] = draw(BAD_COUNT)
    elif defect == "rank":
        record["rank"] = draw(st.integers(1, 10**6))
    elif defect == "deep":
        record["detail"] = draw(DEEP)
    elif defect == "huge":
        record["loss"] = 10**400
    else:
        return draw(JUNK.filter(lambda v: not isinstance(v, dict)))
    return record


BAD_OUTCOME = st.one_of(
    JUNK.filter(lambda v: not isinstance(v, dict)),
    st.fixed_dictionaries(
        {
            "decision_id": st.one_of(st.just(""), JUNK.filter(lambda v: not isinstance(v, str))),
            "rank": st.just(0),
            "outcome": st.just("applied"),
            "step": st.just(1),
            "tick": st.just(1),
        }
    ),
    st.fixed_dictionaries(
        {
            "decision_id": st.just("x-d00001"),
            "rank": st.just(0),
            "outcome": st.text(max_size=8).filter(lambda o: o not in ("applied", "failed")),
            "step": st.just(1),
            "tick": st.just(1),
        }
    ),
)
# What a display would show of a batch, made hostile.
DISPLAY = st.fixed_dictionaries(
    {},
    optional={
        "max_steps": st.one_of(st.just(10**400), st.just(2**80), JUNK),
        "batch_size": st.one_of(st.just(10**400), st.just(2**80), JUNK),
        "ts": JUNK,
    },
)


@st.composite
def hostile(draw: st.DrawFn, step: int, token: str) -> tuple[Any, str, int]:
    """(batch, the family of rejection it must add to, by how much) near rank 0's `step`.

    Every mapping carries the run's own `token` but for the `token` family: each is
    refused for its own defect, not for lacking the token.
    """
    family = draw(
        st.sampled_from(["not_mapping", "header", "token", "stale", "duplicate", "ahead", "items"])
    )
    plausible = {
        "token": token,
        "rank": 0,
        "step": step,
        "tick": step,
        "events": [{"kind": "nonfinite_loss", "rank": 0, "step": step, "severity": "critical"}],
        "metrics": [{"step": step, "tick": step, "rank": 0, "loss": 1e6, "step_time_s": 99.0}],
    }
    if family == "not_mapping":
        # Not a mapping, so it carries no token: refused by the token check, before parsing.
        return draw(JUNK.filter(lambda v: not isinstance(v, dict))), "token", 1
    if family == "header":
        batch: dict[str, Any] = {**plausible, "events": draw(st.lists(bad_event(), max_size=3))}
        broken = draw(st.sampled_from(["rank", "rank_outside", "step", "tick", "tick_far"]))
        if broken == "rank":
            batch["rank"] = draw(BAD_COUNT)
        elif broken == "rank_outside":
            batch["rank"] = draw(st.integers(1, 10**9))
        elif broken == "tick_far":
            batch["tick"] = 10**12
        else:
            batch[broken] = draw(BAD_COUNT)
        if broken in ("rank", "step") and draw(st.booleans()):
            del batch[broken]  # missing (a missing tick is the step's)
        return {**batch, **draw(DISPLAY)}, "batch", 1
    if family == "token":
        return {**plausible, "token": OTHER_TOKEN, **draw(DISPLAY)}, "token", 1
    if family == "stale":
        incarnation = draw(st.one_of(st.integers(2, 10**6), st.just(0)))
        return {**plausible, "incarnation": incarnation, "seq": 10**9}, "stale", 1
    if family == "duplicate":
        return {**plausible, "incarnation": 1, "seq": draw(st.integers(-5, 1))}, "duplicate", 1
    if family == "ahead":
        return {**plausible, "incarnation": 1, "seq": draw(st.integers(10**9, 10**15))}, "ahead", 1
    events = draw(st.lists(bad_event(), max_size=4))
    metrics = draw(st.lists(bad_metrics(), max_size=4))
    outcomes = draw(st.lists(BAD_OUTCOME, max_size=3))
    batch = {"token": token, "rank": 0, "step": step, "events": events, "metrics": metrics,
             "outcomes": outcomes}  # fmt: skip
    return {**batch, **draw(DISPLAY)}, "items", len(events) + len(metrics) + len(outcomes)


def families(rejected: dict[str, int]) -> Counter[str]:
    """Rejection counts summed by family (see `hostile`)."""
    out: Counter[str] = Counter()
    for reason, n in rejected.items():
        if reason == "batch_unknown_field":
            continue  # a count of fields, beside the batch's own verdict
        if reason in ("batch_not_mapping", "token"):
            out[reason] += n
        elif reason == "batch_stale_incarnation":
            out["stale"] += n
        elif reason == "batch_duplicate_seq":
            out["duplicate"] += n
        elif reason == "batch_seq_too_far_ahead":
            out["ahead"] += n
        elif reason.startswith("batch_"):
            out["batch"] += n
        else:
            out["items"] += n
    return out


def shown(event: dict[str, Any]) -> bool:
    """True if a display event carries values a well-formed run never sends."""
    if event.get("event") == "anomaly":
        return event.get("step") in (10**15, 10**12) or not isinstance(event.get("kind"), str)
    if event.get("event") == "progress":
        return (
            any(isinstance(event.get(key), int) and event[key] >= 2**53 for key in ("total",))
            or event.get("loss") == 1e6
        )
    return False


@pytest.mark.slow
def test_live_supervisor_survives_fuzzed_batches(ray_cluster: None, tmp_path: Path) -> None:
    """Hundreds of generated malformed batches (wrong types, huge and NaN numbers, missing
    fields, unknown kinds, deep nesting, another run's token, stale incarnations, duplicate
    and far-ahead sequence numbers) sent while a real run trains: every one is refused and
    counted by reason in summary.json, displays never see them, and the run completes with
    its NaN rolled back exactly once."""
    policy = tmp_path / "nan.yaml"
    policy.write_text(POLICY)
    argv = ["--steps", "60", "--layers", "1", "--width", "32", "--sample-every", "0"]
    spec = RunSpec(
        target=TARGET,
        policy=str(policy),
        run_dir=str(tmp_path / "run"),
        argv=argv,
        faults=[
            {"kind": "nan_loss", "at_step": NAN_AT, "rank": 0},
            # Slow steps until the NaN (>= 10 s; the fuzzing takes ~5), so the fuzzing comes first.
            {"kind": "slow_loader", "at_step": 0, "duration": NAN_AT, "seconds": 0.25, "rank": 0},
        ],
    )
    actor = SupervisorActor.remote(spec.to_dict())  # type: ignore[attr-defined]
    ray.get(actor.start.remote())  # type: ignore[attr-defined]
    deadline = time.monotonic() + 200
    step = 0
    while step < 3 and time.monotonic() < deadline:
        step = ray.get(actor.status.remote(spec.token))["step"].get(0, 0)  # type: ignore[attr-defined]
        time.sleep(0.1)
    assert step >= 3, "the run did not start"

    expected: Counter[str] = Counter()
    cursor = 0
    leaked: list[dict[str, Any]] = []

    # Randomized: a draw that is no defect at all (see `bad_event`) shows up here as
    # one item fewer refused than generated, and `test_every_drawn_defect_is_refused`
    # finds it without Ray.
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def fuzz(data: st.DataObject) -> None:
        nonlocal cursor
        batch, family, count = data.draw(hostile(step, spec.token))
        reply = ray.get(actor.report.remote(batch))  # type: ignore[attr-defined]
        assert isinstance(reply, list)
        if family != "items":  # refused whole: no commands for it
            assert reply == []
        expected[family] += count
        events, cursor = ray.get(actor.events.remote(cursor, spec.token))  # type: ignore[attr-defined]
        leaked.extend(e for e in events if shown(e))

    fuzz()
    status = ray.get(actor.status.remote(spec.token))  # type: ignore[attr-defined]
    assert max(status["step"].values()) < NAN_AT, "the NaN must come after the fuzzing"
    assert families(status["rejected"]) == expected
    assert leaked == []

    summary = finished(actor)
    assert summary["status"] == "completed"
    assert families(summary["rejected"]) == expected
    assert (tmp_path / "run" / "summary.json").exists()
    decisions = read_jsonl(tmp_path / "run" / "decisions.jsonl")
    assert [(d["rule"], d["action"], d["outcome"]) for d in decisions] == [
        ("nan-rollback", "rollback", "applied")
    ]
    assert decisions[0]["anomaly"]["step"] == NAN_AT
    # Only the real rank's records reached the run directory.
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all(m["rank"] == 0 and m.get("step_time_s") != 99.0 for m in metrics)
    assert all(not isinstance(m["loss"], float) or math.isfinite(m["loss"]) for m in metrics)
    anomalies = read_jsonl(tmp_path / "run" / "anomalies.jsonl")
    assert NAN_AT in [a["step"] for a in anomalies if a["kind"] == "nonfinite_loss"]
    assert all(a["rank"] == 0 and a["step"] <= 100 and a["tick"] <= 200 for a in anomalies)


def _refused_items(batch: dict[str, Any]) -> tuple[int, Counter[str]]:
    """(items accepted, rejections) of one batch from rank 0 at its first report."""
    rejected: Counter[str] = Counter()
    report = validate_batch(batch, world_size=1, last=None, origin=RankMark(0, 0, 0.0), now=0.0,
                            limits=Limits(), rejected=rejected)  # fmt: skip
    assert report is not None
    return len(report.events) + len(report.metrics) + len(report.outcomes), rejected


@pytest.mark.parametrize(
    "event",
    [
        {"kind": "oom", "rank": 0, "step": 3, "severity": "critical", "tick": None},
        {"kind": "oom", "rank": 0, "step": 3, "severity": "critical", "value": "Inf"},
    ],
)
def test_what_the_randomized_run_miscounted_is_valid(event: dict[str, Any]) -> None:
    """The 276 vs 275 of a randomized run: `tick: null` (the step stands for it) and a value
    spelled "Inf" are valid, so an event "broken" only that way was accepted, not refused."""
    accepted, rejected = _refused_items({"rank": 0, "step": 10, "events": [event]})
    assert accepted == 1 and rejected == Counter()


@settings(max_examples=500, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))  # fmt: skip
@given(
    st.lists(bad_event(), max_size=4),
    st.lists(bad_metrics(), max_size=4),
    st.lists(BAD_OUTCOME, max_size=3),
    st.integers(3, 50),
)
def test_every_drawn_defect_is_refused(
    events: list[Any], metrics: list[Any], outcomes: list[Any], step: int
) -> None:
    """Each item the live fuzz test draws as broken is refused and counted once, whatever the step."""
    batch = {"rank": 0, "step": step, "events": events, "metrics": metrics, "outcomes": outcomes}
    accepted, rejected = _refused_items(batch)
    assert accepted == 0
    assert families(dict(rejected)) == Counter(items=len(events) + len(metrics) + len(outcomes))


def test_what_the_controller_refuses_moves_no_watcher(ray_cluster: None, tmp_path: Path) -> None:
    """A batch refused for its tick (10**12) and items refused for their rank move neither
    the hang watch nor the display's numbers; the valid batch before them does."""
    policy = tmp_path / "nan.yaml"
    policy.write_text(POLICY)
    # Every step time counts (no first-steps allowance), so one record shows in the p99.
    spec = RunSpec(target=TARGET, policy=str(policy), run_dir=str(tmp_path / "run"), workers=2,
                   hang_watch={"first_steps": 0})  # fmt: skip
    sup = SupervisorActor.__ray_actor_class__(spec.to_dict())  # type: ignore[attr-defined]

    def send(rank: int, tick: int, **record: Any) -> None:
        metrics = [{"step": 6, "tick": 6, "rank": 0, **record}]
        batch = {"token": spec.token, "rank": rank, "step": 6, "tick": tick, "metrics": metrics}
        asyncio.run(sup.report(batch))

    send(0, 6, loss=2.0, step_time_s=0.1)
    send(0, 10**12, loss=1e6, step_time_s=99.0)  # refused whole: tick too far ahead
    send(1, 6, loss=1e6, step_time_s=99.0)  # its record is about rank 0: refused
    assert sup.watch._ranks[0].tick == 6
    assert sup.watch.p99(0) == 0.1 and sup.watch.p99(1) == 0.0
    assert sup.feed.last_metrics == {0: {"step": 6, "tick": 6, "rank": 0, "loss": 2.0,
                                         "step_time_s": 0.1}}  # fmt: skip
    assert sup.controller.rejected == {"batch_tick_too_far_ahead": 1, "metrics_invalid": 1}
    sup.run_dir.close()


def test_a_report_its_slot_refuses_is_answered_with_nothing(
    ray_cluster: None, tmp_path: Path
) -> None:
    """A replaced process's report that holds at a flagged step gets nothing back, not whether
    that step is settled: the last batch the controller took was another rank's."""
    policy = tmp_path / "nan.yaml"
    policy.write_text(POLICY)
    spec = RunSpec(target=TARGET, policy=str(policy), run_dir=str(tmp_path / "run"), workers=2)
    sup = SupervisorActor.__ray_actor_class__(spec.to_dict())  # type: ignore[attr-defined]
    head = {"token": spec.token, "seq": 1, "step": 6, "tick": 6}
    assert asyncio.run(sup.report({**head, "rank": 0, "incarnation": 1})) == []
    stale = {**head, "rank": 1, "incarnation": 9, "holding": 6}
    assert asyncio.run(sup.report(stale)) == []
    assert sup.controller.rejected["batch_stale_incarnation"] == 1
    sup.run_dir.close()
