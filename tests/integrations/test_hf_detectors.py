"""The Guard's batch detectors under the Hugging Face callback, in a real `transformers.Trainer`:
padding and duplicates read the inputs the Trainer hands the model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from remedy.rundir.writer import read_jsonl

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(180)]

VOCAB, LENGTH, ROWS = 64, 20, 4


class Samples(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Samples of random tokens, in order (an iterable: the Trainer does not shuffle it), ROWS to
    a batch. `padded_at`: every sample of that batch is 80% padding; `period`: the stream
    serves its first `period` batches' samples over and over, as a loader restarted at its
    beginning within an epoch does."""

    def __init__(self, batches: int, *, padded_at: int | None = None, period: int | None = None):
        self.batches, self.padded_at, self.period = batches, padded_at, period

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(self.batches * ROWS):
            batch = i // ROWS
            seed = i % (self.period * ROWS) if self.period else i
            ids = torch.randint(1, VOCAB, (LENGTH,), generator=torch.Generator().manual_seed(seed))
            mask = torch.ones_like(ids)
            if batch == self.padded_at:
                real = LENGTH // 5
                ids[real:], mask[real:] = 0, 0
            labels = ids.masked_fill(mask == 0, -100)
            yield {"input_ids": ids, "attention_mask": mask, "labels": labels}


def train(tmp_path: Path, samples: Samples, steps: int) -> Path:
    """A tiny GPT-2 under Trainer with the callback for `steps` steps; the run directory."""
    from remedy.integrations.hf import RemedyCallback  # noqa: PLC0415 - after the importorskip
    from tests.integrations.hf_builders import cpu_args, tiny_gpt2  # noqa: PLC0415

    run = tmp_path / "run"
    transformers.Trainer(
        model=tiny_gpt2(vocab_size=VOCAB),
        args=cpu_args(tmp_path / "out", steps, per_device_train_batch_size=ROWS),
        train_dataset=samples,
        callbacks=[RemedyCallback(run_dir=run)],
    ).train()
    return run


def anomalies(run: Path, kind: str) -> list[dict[str, Any]]:
    path = run / "anomalies.jsonl"
    return [a for a in read_jsonl(path) if a["kind"] == kind] if path.exists() else []


def test_a_batch_of_80_percent_padding_raises_padding_ratio(tmp_path: Path) -> None:
    """The sixth batch is 80% padding: `padding_ratio` at that step, with that share, and only there."""
    run = train(tmp_path, Samples(12, padded_at=6), steps=12)
    [found] = anomalies(run, "padding_ratio")
    assert (found["step"], found["value"], found["threshold"]) == (6, pytest.approx(0.8), 0.75)


def test_a_stream_serving_the_same_batches_again_raises_duplicate_samples(tmp_path: Path) -> None:
    """From step 16 the stream serves its first 16 batches again: `duplicate_samples` (default
    thresholds: 8 of the last 20 sampled rows repeat one), never before the repeat began."""
    run = train(tmp_path, Samples(48, period=16), steps=48)
    found = anomalies(run, "duplicate_samples")
    assert found, "the repeated batches were not seen"
    assert all(a["step"] >= 16 for a in found)
    assert found[0]["details"]["hits"] >= 8
