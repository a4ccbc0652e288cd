"""Data detectors: real slow loaders stall, padded batches and repeated data are reported, and the
clean example stream raises nothing."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from examples.gpt_model import GPT, GPTConfig, SyntheticCorpus, lm_loss
from remedy.rank.chaos.faults import Fault
from remedy.rank.detectors import (
    DataStallDetector,
    DuplicateSamplesDetector,
    PaddingRatioDetector,
)
from remedy.rank.detectors.duplicates import shingle_hashes
from remedy.rank.detectors.testing import GuardedRun, feed, run_guarded, step_stats

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]


def guarded_tiny(
    tmp_path: Path, steps: int, data: object, detectors: list, **kw: object
) -> GuardedRun:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=64, block_size=32))
    return run_guarded(
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3),
        loss_fn=lm_loss,
        data=data,
        steps=steps,
        detectors=detectors,
        policy_dir=tmp_path,
        **kw,  # type: ignore[arg-type]
    )


# ------------------------------------------------------------------ data_stall
def test_real_slow_loader_is_critical_stall(tmp_path: Path) -> None:
    """chaos slow_loader sleeps 0.1 s per batch from step 30 (steps take ~10 ms): critical
    data_stall once the window's median is slow, i.e. at the third slow batch."""
    corpus = SyntheticCorpus(block_size=32, batch_size=8)
    slow = Fault(kind="slow_loader", at_step=30, duration=10, seconds=0.1)
    run = guarded_tiny(tmp_path, 45, corpus.batch, [DataStallDetector()], faults=[slow])
    (ev,) = run.events
    assert (ev.kind, ev.step, ev.severity) == ("data_stall", 32, "critical")
    assert ev.value is not None and ev.value > 2.5


def test_one_slow_batch_does_not_fire(tmp_path: Path) -> None:
    """A single slow batch (a sleeping data source) is absorbed by the window median."""
    corpus = SyntheticCorpus(block_size=32, batch_size=8)

    def data(i: int) -> torch.Tensor:
        if i == 20:
            time.sleep(0.2)
        return corpus.batch(i)

    assert guarded_tiny(tmp_path, 40, data, [DataStallDetector()]).events == []


@pytest.mark.parametrize(
    ("wait", "severity"), [(0.011, "warning"), (0.03, "critical"), (0.009, None)]
)
def test_stall_ratio_thresholds(wait: float, severity: str | None) -> None:
    """Loader/compute above 1.0 is a warning, above 2.5 critical (10 ms steps, 20 of them)."""
    stream = [step_stats(i, step_time_s=0.01, loader_time_s=wait) for i in range(20)]
    events = feed(DataStallDetector(), stream)
    assert [e.severity for e in events] == ([severity] if severity else [])


def test_a_stall_must_last_min_stall_s() -> None:
    """Five 6 ms waits on 2 ms steps (a busy machine's preemptions landing in the loader) are not
    a stall; the same ratio held for 0.25 s of training is, once."""
    blip = [step_stats(i, step_time_s=0.002, loader_time_s=0.006 if 10 <= i < 15 else 0.0005)
            for i in range(40)]  # fmt: skip
    assert feed(DataStallDetector(), blip) == []
    held = [step_stats(i, step_time_s=0.002, loader_time_s=0.006) for i in range(40)]
    events = feed(DataStallDetector(), held)
    assert [(e.step, e.severity) for e in events] == [(31, "critical")]


def test_a_stall_longer_than_the_step_and_one_long_stall_are_reported() -> None:
    """0.9 s waits on 0.8 s steps (half the throughput gone) and one 3 s wait: each an event."""
    even = [step_stats(i, step_time_s=0.8, loader_time_s=0.9 if i >= 10 else 0.0)
            for i in range(20)]  # fmt: skip
    assert [(e.step, e.severity) for e in feed(DataStallDetector(), even)] == [(12, "warning")]
    once = [step_stats(i, step_time_s=0.8, loader_time_s=3.0 if i == 10 else 0.001)
            for i in range(20)]  # fmt: skip
    (ev,) = feed(DataStallDetector(), once)
    assert (ev.step, ev.severity, ev.details["single_wait"]) == (10, "warning", True)


# --------------------------------------------------------------- padding_ratio
def test_padding_from_attention_mask() -> None:
    """A Hugging Face style batch with 80% masked-out tokens is padding_ratio (info)."""
    mask = torch.zeros(4, 10, dtype=torch.long)
    mask[:, :2] = 1
    det = PaddingRatioDetector()
    det.inspect_batch({"input_ids": torch.ones(4, 10, dtype=torch.long), "attention_mask": mask})
    (ev,) = det.observe(step_stats(3))
    assert (ev.kind, ev.severity) == ("padding_ratio", "info")
    assert ev.value == pytest.approx(0.8)


def test_padding_from_pad_id_and_custom_extractor() -> None:
    """With a pad id the token ids are counted; `tokens_fn` finds ids in any batch shape."""
    ids = torch.full((2, 8), 7)
    ids[:, :1] = 3
    det = PaddingRatioDetector(pad_id=7, tokens_fn=lambda b: b["text"]["ids"])
    det.inspect_batch({"text": {"ids": ids}})
    assert [e.kind for e in det.observe(step_stats(0))] == ["padding_ratio"]
    det.inspect_batch({"text": {"ids": torch.full((2, 8), 3)}})
    assert det.observe(step_stats(1)) == []


def test_padding_silent_without_pad_information(tmp_path: Path) -> None:
    """Plain token tensors and no pad id: nothing to measure, nothing reported (example data)."""
    corpus = SyntheticCorpus(block_size=32, batch_size=8)
    assert guarded_tiny(tmp_path, 30, corpus.batch, [PaddingRatioDetector()]).events == []


# ----------------------------------------------------------- duplicate_samples
def test_shingles_of_equal_rows_are_equal() -> None:
    """Shingle hashes depend on the tokens only; all-padding shingles are dropped when asked."""
    rows = torch.tensor([[1, 2, 3, 4, 5, 0, 0, 0], [1, 2, 3, 4, 5, 0, 0, 0]]).numpy()
    a, b = shingle_hashes(rows, 3)
    assert (a == b).all() and len(a) == 6
    (c, _) = shingle_hashes(rows, 3, pad_id=0)
    assert len(c) == 5


def test_repeating_loader_is_duplicate_samples(tmp_path: Path) -> None:
    """A loader stuck on a 6-batch loop after step 100 (a shard served again and again):
    duplicate_samples within about 100 steps (2 rows sampled every 8 batches); nothing before."""
    corpus = SyntheticCorpus(block_size=32, batch_size=8)
    run = guarded_tiny(
        tmp_path,
        200,
        lambda i: corpus.batch(i if i < 100 else 100 + i % 6),
        [DuplicateSamplesDetector()],
    )
    ev = run.first("duplicate_samples")
    assert ev is not None, run.kinds()
    assert 100 < ev.step <= 200
    assert ev.details["hits"] >= 8


def test_clean_corpus_has_no_duplicates() -> None:
    """3000 batches of the example corpus (whose text repeats a little, as real text does): silent."""
    corpus = SyntheticCorpus(block_size=32, batch_size=8)
    det = DuplicateSamplesDetector()
    events = []
    for i in range(3000):
        det.inspect_batch(corpus.batch(i))
        events += det.observe(step_stats(i))
    assert events == []


def test_duplicate_reset_forgets_index() -> None:
    """After a rollback the replayed batches are not duplicates of their first pass."""
    corpus = SyntheticCorpus(block_size=32, batch_size=8)
    det = DuplicateSamplesDetector(every=1)
    for i in range(40):
        det.inspect_batch(corpus.batch(i))
        det.observe(step_stats(i))
    det.reset()
    events = []
    for i in range(40):
        det.inspect_batch(corpus.batch(i))
        events += det.observe(step_stats(40 + i))
    assert events == []
