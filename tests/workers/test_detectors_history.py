"""Detectors' histories are state at a step: after a rollback or an adoption they are the restored timeline's."""

from __future__ import annotations

import json
import math
import pickle
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.gpt_model import GPT, GPTConfig, SyntheticCorpus, lm_loss
from remedy.rank.detectors import (
    DetectorSuite,
    GradNormDetector,
    LossDivergenceDetector,
    LossOscillationDetector,
    LossSpikeDetector,
    ScalerOverflowDetector,
    default_detectors,
)
from remedy.rank.detectors.testing import feed, observe_only_policy, step_stats
from remedy.rank.loop.stats import StepStats

pytestmark = pytest.mark.timeout(120)

RESTORED_AT = 150  # the boundary the snapshot is taken at
ABANDONED = 40  # steps of the abandoned timeline after it


def noisy(i: int, rng: random.Random, *, scale: bool = False) -> StepStats:
    """A clean step: a slowly falling loss and a norm around 1, with batch noise; with `scale`,
    an AMP step (a skip now and then, as a scaler finding its scale)."""
    extra: dict[str, Any] = {}
    if scale:
        skipped = rng.random() < 0.05
        extra = {"loss_scale": 1024.0, "scaler_skipped": skipped, "optimizer_skipped": skipped}
    return step_stats(
        i,
        loss=3.0 * math.exp(-i / 400) * (1 + 0.1 * rng.gauss(0, 1)),
        grad_norm=1.0 + 0.2 * abs(rng.gauss(0, 1)),
        **extra,
    )


def abandoned(i: int) -> StepStats:
    """A step of a timeline that goes wrong: the loss climbs, norms triple, a scaler storm."""
    storm = i % 2 == 0
    return step_stats(
        i,
        loss=2.3 + 0.02 * (i - RESTORED_AT),
        grad_norm=3.0,
        loss_scale=1024.0,
        scaler_skipped=storm,
        optimizer_skipped=storm,
    )


HISTORIED: dict[str, Callable[[], Any]] = {
    "loss_spike": LossSpikeDetector,
    "grad_norm": GradNormDetector,
    "loss_divergence": lambda: LossDivergenceDetector(block=10),
    "loss_oscillation": lambda: LossOscillationDetector(block=10),
    "scaler_overflow": ScalerOverflowDetector,
}


def timeline(
    make: Callable[[], Any], steps: int, *, seed: int = 0, scale: bool = False
) -> tuple[Any, list[StepStats]]:
    """A detector fed `steps` clean steps, and the stream it was fed."""
    rng = random.Random(seed)
    stream = [noisy(i, rng, scale=scale) for i in range(steps)]
    det = make()
    feed(det, stream)
    return det, stream


def continuation(seed: int = 1) -> list[StepStats]:
    """The steps after the boundary on the restored timeline, with a x10 spike in them."""
    rng = random.Random(seed)
    out = [noisy(i, rng, scale=True) for i in range(RESTORED_AT, RESTORED_AT + 60)]
    out[30].loss *= 10
    out[30].grad_norm *= 30
    return out


@pytest.mark.parametrize("name", sorted(HISTORIED))
def test_after_a_rollback_the_history_is_the_restored_timelines(name: str) -> None:
    """Snapshot at step 150, 40 abandoned steps, restore: the history and every later verdict
    are those of a detector that never saw the abandoned steps."""
    make = HISTORIED[name]
    scale = name == "scaler_overflow"
    live, _ = timeline(make, RESTORED_AT, scale=scale)
    twin, _ = timeline(make, RESTORED_AT, scale=scale)
    saved = live.state_dict()
    feed(live, [abandoned(i) for i in range(RESTORED_AT, RESTORED_AT + ABANDONED)])
    assert live.state_dict() != saved, "the abandoned steps changed the history"
    live.load_state_dict(saved)
    assert live.state_dict() == twin.state_dict()
    after = continuation()
    got = [(e.kind, e.step, e.value) for e in feed(live, after)]
    assert got == [(e.kind, e.step, e.value) for e in feed(twin, after)]


@pytest.mark.parametrize("name", sorted(HISTORIED))
def test_after_an_adoption_a_fresh_detector_has_the_sources_history(name: str) -> None:
    """A replacement's fresh detector loads the history the source broadcast (pickled, as
    plain numbers a JSON file could hold) and judges every later step as the source does."""
    make = HISTORIED[name]
    scale = name == "scaler_overflow"
    source, _ = timeline(make, RESTORED_AT, scale=scale)
    sent = pickle.loads(pickle.dumps(source.state_dict()))
    assert json.loads(json.dumps(sent)) == sent, "plain numbers, no tensors"
    fresh = make()
    fresh.load_state_dict(sent)
    assert fresh.state_dict() == source.state_dict()
    after = continuation()
    assert [(e.kind, e.step) for e in feed(fresh, after)] == [
        (e.kind, e.step) for e in feed(source, after)
    ]


def test_a_spike_right_after_an_adoption_is_found() -> None:
    """The x10 spike 5 steps after a rank restart: a detector that adopted the history
    fires on it; a reset one (the old behaviour) would have judged it by its warm-up bound only."""
    source, _ = timeline(LossSpikeDetector, RESTORED_AT)
    fresh = LossSpikeDetector()
    fresh.load_state_dict(source.state_dict())
    rng = random.Random(3)
    after = [noisy(i, rng) for i in range(RESTORED_AT, RESTORED_AT + 6)]
    after[5].loss *= 10
    assert [(e.kind, e.step) for e in feed(fresh, after)] == [("loss_spike", RESTORED_AT + 5)]


def test_skipped_updates_are_judged_but_never_join_the_norm_baseline() -> None:
    """Norms of steps whose update was skipped (a frozen model meeting skipped batches) stay
    out of the median: the ordinary norms after them are not explosions."""
    det = GradNormDetector()
    # The HF case: after a rollback, 10 dropped batches of norm 0.75, then norms of 12-26.
    base = [8.0 + (i % 5) for i in range(30)]
    feed(det, [step_stats(i, grad_norm=n) for i, n in enumerate(base)])
    before = det.state_dict()
    skipped = [step_stats(30 + i, grad_norm=0.75, optimizer_skipped=True) for i in range(40)]
    assert feed(det, skipped) == []
    assert det.state_dict() == before
    assert feed(det, [step_stats(70 + i, grad_norm=12.0 + i) for i in range(15)]) == []
    # A skipped step is still judged: an exploded norm is reported even if its update was dropped.
    (ev,) = det.observe(step_stats(90, grad_norm=500.0, optimizer_skipped=True))
    assert ev.kind == "grad_norm_explosion"


def test_until_a_history_exists_the_absolute_bounds_judge_and_the_detector_says_so() -> None:
    """A new run's first steps: the detectors say they are warming up, `explode_above`, the
    spike's `loss_above` and its warm-up bound judge, and the suite says it once until ready."""
    norm, spike = GradNormDetector(explode_above=100.0), LossSpikeDetector(loss_above=30.0)
    suite = DetectorSuite([norm, spike])
    assert suite.warming_changed() == ["grad_norm", "loss_spike"]
    assert suite.warming_changed() is None, "said once"
    events = suite.observe(step_stats(0, loss=40.0, grad_norm=500.0))
    assert sorted((e.kind, e.threshold) for e in events) == [
        ("grad_norm_explosion", 100.0),
        ("loss_spike", 30.0),
    ]
    for i in range(1, 25):
        suite.observe(step_stats(i, loss=2.0, grad_norm=1.0))
    assert suite.warming_changed() == []
    suite.reset()
    assert suite.warming() == ["grad_norm", "loss_spike"], "a new run warms up again"


def test_the_suite_restores_detectors_with_history_and_resets_the_others() -> None:
    """Suite state: every detector with history by name (a repeated name numbered); one without
    `state_dict` is reset; a snapshot with no histories (an older checkpoint) resets them all."""
    a, b = LossSpikeDetector(), LossSpikeDetector(z_threshold=20.0)
    suite = DetectorSuite([a, b, *default_detectors(hardware=False)[1:2]])
    for i in range(30):
        suite.observe(step_stats(i, loss=2.0 + 0.01 * (i % 3), grad_norm=1.0))
    state = suite.state_dict()
    assert {"loss_spike", "loss_spike#2", "grad_norm"} <= set(state)
    twin = DetectorSuite(
        [
            LossSpikeDetector(),
            LossSpikeDetector(z_threshold=20.0),
            *default_detectors(hardware=False)[1:2],
        ]
    )
    twin.load_state_dict(state)
    assert twin.state_dict() == state
    twin.load_state_dict(None)
    assert twin.warming() == ["loss_spike", "loss_spike", "grad_norm"]


def guard(tmp_path: Path, seed: int = 0) -> Any:
    """A single-process Guard over a tiny GPT, snapshots every 10 steps."""
    from remedy.rank.guard import Guard, GuardConfig  # noqa: PLC0415
    from remedy.rank.link.context import WorkerContext  # noqa: PLC0415

    tmp_path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=1, n_embd=32, block_size=16))
    corpus = SyntheticCorpus(block_size=16, batch_size=4)
    return Guard(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        loss_fn=lm_loss,
        data=corpus.batch,
        max_steps=200,
        config=GuardConfig(
            snapshot_every=10, checkpoint_every=0, policy=str(observe_only_policy(tmp_path))
        ),
        context=WorkerContext(),
    )


def run_to(g: Any, step: int, *, at: int = -1, then: Callable[[], Any] = lambda: None) -> None:
    """Train `g` up to `step` (the loop then closes the Guard), calling `then` at boundary `at`."""
    for batch in g:
        if g.step_count == at:
            then()
        g.step(batch)
        if g.step_count >= step:
            return


@pytest.mark.usefixtures("one_torch_thread")
def test_a_guards_rollback_and_adoption_restore_the_histories_of_the_restored_step(
    tmp_path: Path,
) -> None:
    """A real Guard: its snapshot at step 30 holds the detectors' histories of a twin that ran 30
    steps; a rollback from step 45 and a fresh Guard adopting `train_state` both end with them."""
    from remedy.rank.state import train_state  # noqa: PLC0415

    twin = guard(tmp_path / "twin")
    run_to(twin, 30)
    expected = twin.detectors.state_dict()
    twin.close()

    g = guard(tmp_path / "g")
    captured: list[dict[str, Any]] = []
    # What a source broadcasts after a rank restart, captured at step 30's boundary.
    run_to(g, 45, at=30, then=lambda: captured.append(train_state.capture(g)))
    state = captured[0]
    snap = g.snapshots.newest_at_or_before(30)
    assert snap is not None and snap.step == 30
    assert snap.detectors == expected
    assert g.detectors.state_dict() != expected
    g.restore(snap)
    assert g.detectors.state_dict() == expected

    fresh = guard(tmp_path / "fresh", seed=1)  # a replacement: other weights, no history
    assert fresh.detectors.state_dict() != expected
    train_state.adopt(fresh, pickle.loads(pickle.dumps(state)))
    assert fresh.detectors.state_dict() == expected
    fresh.close()


@pytest.mark.usefixtures("one_torch_thread")
def test_a_new_runs_metrics_say_which_detectors_are_warming_up(tmp_path: Path) -> None:
    """The first metrics record of a run names the detectors still warming up; later ones say
    nothing until the set changes."""
    g = guard(tmp_path)
    run_to(g, 25)
    records = [s.extra for s in g.recent_stats]
    g.close()
    assert {"loss_spike", "grad_norm", "loss_divergence"} <= set(records[0]["detectors_warming"])
    changed = [i for i, r in enumerate(records) if "detectors_warming" in r]
    assert changed[0] == 0 and len(changed) <= 3
    assert "loss_spike" not in records[changed[-1]]["detectors_warming"], "ready by step 21"


def test_a_durable_checkpoint_carries_the_histories_and_an_older_one_resets(
    tmp_path: Path,
) -> None:
    """A checkpoint written from a snapshot with histories loads them back; one written without
    (before histories were kept) loads as None, which resets the detectors."""
    from remedy.rank.state.checkpoint_store import CheckpointStore  # noqa: PLC0415
    from remedy.rank.state.snapshots import Snapshot, capture_rng  # noqa: PLC0415

    suite = DetectorSuite([LossSpikeDetector(), GradNormDetector()])
    for i in range(30):
        suite.observe(step_stats(i, loss=2.0 + 0.01 * (i % 3), grad_norm=1.0 + 0.1 * (i % 2)))
    store = CheckpointStore(tmp_path)
    state = Snapshot(30, 30, 30, {"w": torch.ones(2)}, {}, None, None, capture_rng()).to_state()
    store.save_now(Snapshot.from_state({**state, "detectors": suite.state_dict()}))
    older = {k: v for k, v in state.items() if k != "detectors"}
    store.save_now(Snapshot.from_state({**older, "step": 40}))
    assert store.load(30).detectors == suite.state_dict()
    fresh = DetectorSuite([LossSpikeDetector(), GradNormDetector()])
    fresh.load_state_dict(store.load(30).detectors)
    assert fresh.state_dict() == suite.state_dict()
    fresh.load_state_dict(store.load(40).detectors)
    assert fresh.warming() == ["loss_spike", "grad_norm"]
    store.close()
