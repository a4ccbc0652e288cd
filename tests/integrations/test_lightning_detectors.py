"""The Guard's batch and loader detectors under Lightning's callback, in a real `lightning.Trainer`:
padding and duplicates read the batches Lightning hands over, and a stall in the fit loop's
fetch is a loader wait."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from remedy.rundir.writer import read_jsonl

lightning = pytest.importorskip("lightning")

from tests.integrations.lightning_builders import quiet_trainer  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(180)]

VOCAB, LENGTH, ROWS = 64, 20, 4


class NextToken(lightning.LightningModule):  # type: ignore[misc]
    """A bigram model over token batches {input_ids, attention_mask}; padding is not trained."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        logits = self.head(self.embed(ids[:, :-1]))
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="none"
        )
        keep = mask[:, 1:].reshape(-1).float()
        return (loss * keep).sum() / keep.sum().clamp(min=1)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def token_batch(seed: int, *, real: int = LENGTH) -> dict[str, torch.Tensor]:
    """ROWS rows of random tokens (never alike); only the first `real` of each are not padding."""
    ids = torch.randint(1, VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[:, real:], mask[:, real:] = 0, 0
    return {"input_ids": ids, "attention_mask": mask}


class Batches(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Ready batches (a DataLoader with batch_size=None hands them over as they are); an
    iterable, so Lightning fetches one batch ahead. `stall_at`: the fetch of that batch takes
    3 s; `period`: the loader serves its first `period` batches over and over, as a loader
    restarted at its beginning within an epoch does; `padded_at`: that batch is 80% padding."""

    def __init__(
        self,
        count: int,
        *,
        padded_at: int | None = None,
        period: int | None = None,
        stall_at: int | None = None,
    ) -> None:
        self.count, self.padded_at, self.period, self.stall_at = count, padded_at, period, stall_at

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(self.count):
            if i == self.stall_at:
                time.sleep(3.0)  # a shard that takes seconds to open
            seed = i % self.period if self.period else i
            yield token_batch(seed, real=LENGTH // 5 if i == self.padded_at else LENGTH)


def fit(tmp_path: Path, batches: Batches, steps: int, **trainer: Any) -> Path:
    """Train NextToken on `batches` for `steps` optimizer steps under the callback; the run dir."""
    from remedy.integrations.lightning import RemedyCallback  # noqa: PLC0415 - after importorskip

    torch.manual_seed(0)
    run = tmp_path / "run"
    callbacks = [RemedyCallback(run_dir=run)]
    quiet_trainer(steps, callbacks, default_root_dir=str(tmp_path), **trainer).fit(
        NextToken(), torch.utils.data.DataLoader(batches, batch_size=None)
    )
    return run


def anomalies(run: Path, kind: str) -> list[dict[str, Any]]:
    path = run / "anomalies.jsonl"
    return [a for a in read_jsonl(path) if a["kind"] == kind] if path.exists() else []


def test_a_batch_of_80_percent_padding_raises_padding_ratio(tmp_path: Path) -> None:
    """The sixth batch is 80% padding: `padding_ratio` at that step, with that share, and only there."""
    run = fit(tmp_path, Batches(12, padded_at=6), steps=12)
    [found] = anomalies(run, "padding_ratio")
    assert (found["step"], found["value"], found["threshold"]) == (6, pytest.approx(0.8), 0.75)


def test_a_loader_serving_the_same_batches_again_raises_duplicate_samples(tmp_path: Path) -> None:
    """From step 16 the loader serves its first 16 batches again: `duplicate_samples` (default
    thresholds: 8 of the last 20 sampled rows repeat one), never before the repeat began."""
    run = fit(tmp_path, Batches(48, period=16), steps=48)
    found = anomalies(run, "duplicate_samples")
    assert found, "the repeated batches were not seen"
    assert all(a["step"] >= 16 for a in found)
    assert found[0]["details"]["hits"] >= 8


def test_a_stall_in_the_prefetch_inside_a_step_is_a_loader_wait(tmp_path: Path) -> None:
    """Two micro-batches per step: Lightning fetches batch 16 ahead while it hands over batch 15,
    inside step 7. The 3 s fetch is that step's loader wait, not its step time, and the loader
    detector raises `data_stall`."""
    run = fit(tmp_path, Batches(40, stall_at=16), steps=20, accumulate_grad_batches=2)
    [record] = [m for m in read_jsonl(run / "metrics.jsonl") if m["loader_time_s"] >= 3.0]
    assert record["step"] == 7
    assert record["step_time_s"] < record["loader_time_s"]
    # The single long wait, at that step (the windowed ratio may speak too, on a busy machine).
    [stall] = [a for a in anomalies(run, "data_stall") if a["details"].get("single_wait")]
    assert stall["step"] == 7 and stall["details"]["loader_s"] >= 3.0


@pytest.fixture
def fake_gpu() -> Iterator[Any]:
    """This process's NVML sampler over one fake GPU (NVML has no driver to read here): sampled
    only when the test says (`sample_once`), never by its thread on its own."""
    from remedy.rank.loop.hardware import get_sampler, stop_sampler  # noqa: PLC0415
    from tests.workers.test_hardware import FakeGpu, FakeNvml  # noqa: PLC0415

    stop_sampler()
    gpu = FakeGpu()
    sampler = get_sampler(nvml_lib=FakeNvml([gpu]), interval_s=3600.0)
    sampler.sample_once()  # errors present at start are history
    yield gpu, sampler
    stop_sampler()


def test_a_gpu_ecc_error_reaches_the_hardware_fault_rule(tmp_path: Path, fake_gpu: Any) -> None:
    """Where NVML finds a GPU the callback runs the Guard's hardware monitor: an uncorrected ECC
    error found during step 5 is `gpu_ecc` at step 5, and the bundled `hardware-fault` rule answers it
    (its callback version: `notify`, as `checkpoint_now` is not taken under the callbacks)."""
    gpu, sampler = fake_gpu

    class EccError(lightning.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 6:  # step 5's optimizer step is done; its end is next
                gpu.ecc[1] += 1
                sampler.sample_once()

    from remedy.integrations.lightning import RemedyCallback  # noqa: PLC0415 - after importorskip

    run = tmp_path / "run"
    callbacks = [EccError(), RemedyCallback(run_dir=run)]
    quiet_trainer(10, callbacks, default_root_dir=str(tmp_path)).fit(
        NextToken(), torch.utils.data.DataLoader(Batches(10), batch_size=None)
    )
    [ecc] = anomalies(run, "gpu_ecc")
    assert (ecc["step"], ecc["source"], ecc["severity"]) == (5, "hardware", "critical")
    [decision] = [d for d in read_jsonl(run / "decisions.jsonl") if d["rule"] == "hardware-fault"]
    assert (decision["action"], decision["outcome"]) == ("notify", "applied")
