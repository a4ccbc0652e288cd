"""Under HF's Trainer, the gradient-norm baseline after a rollback is the restored timeline's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from remedy.rundir.writer import read_jsonl

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(900)]

STEPS = 300
EMPTY_AT = 60  # the batch whose labels are all ignored (-100): its loss is 0/0


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Deterministic random token sequences, the labels the inputs (as examples/hf_trainer.py)."""

    def __init__(self, n: int, length: int = 32, vocab: int = 64) -> None:
        self.n, self.length, self.vocab = n, length, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(i)
        ids = torch.randint(0, self.vocab, (self.length,), generator=gen)
        return {"input_ids": ids, "labels": ids.clone()}


class EmptyLabelsAt:
    """A collator that stacks the batch and, for the `at`-th batch (from 0), ignores every label."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.calls = 0

    def __call__(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = {k: torch.stack([it[k] for it in items]) for k in items[0]}
        if self.calls == self.at:
            batch["labels"] = torch.full_like(batch["labels"], -100)
        self.calls += 1
        return batch


class Histories(transformers.TrainerCallback):  # type: ignore[misc]
    """Records (step, tick, detectors' histories) at each step's start, after remedy's callback
    applied the commands due there (a rollback among them)."""

    def __init__(self, remedy: Any) -> None:
        self.remedy = remedy
        self.seen: list[tuple[int, int, dict[str, Any]]] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        guard = self.remedy.guard
        self.seen.append((guard.step_count, guard.tick, guard.detectors.state_dict()))


def train(
    run_dir: Path, *, empty_at: int | None, steps: int = STEPS
) -> tuple[list[dict[str, Any]], Histories]:
    """A tiny GPT-2 under Trainer and the default policy; the run's anomalies and histories."""
    from remedy.integrations.hf import RemedyCallback  # noqa: PLC0415 - after the importorskip
    from tests.integrations.hf_builders import cpu_args, tiny_gpt2  # noqa: PLC0415

    model = tiny_gpt2(n_layer=2, n_embd=64, n_positions=64)
    args = cpu_args(
        run_dir / "hf-output", steps, per_device_train_batch_size=8, max_grad_norm=1.0,
        learning_rate=1e-3, seed=0, logging_steps=10_000,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=Tokens(8 * steps),
        data_collator=EmptyLabelsAt(-1 if empty_at is None else empty_at),
        callbacks=[remedy := RemedyCallback(run_dir=run_dir), histories := Histories(remedy)],
    )
    trainer.train()
    return read_jsonl(run_dir / "anomalies.jsonl"), histories


@pytest.mark.slow
def test_rollback_after_empty_labels_then_clean_steps_raise_no_grad_explosion(
    tmp_path: Path,
) -> None:
    """Empty labels at step 60 are rolled back; the detectors' histories after the rollback are
    those of the restored step, dropped updates never join the norm baseline, and the 240 clean
    steps after raise 0 grad_norm_explosion."""
    anomalies, histories = train(tmp_path, empty_at=EMPTY_AT)
    decisions = read_jsonl(tmp_path / "decisions.jsonl")
    assert any(a["kind"] == "nonfinite_loss" for a in anomalies), "the empty labels are found"
    (rollback,) = [d for d in decisions if d["action"] == "rollback"]
    assert rollback["outcome"] == "applied", rollback
    # The boundary the rollback went back to, seen twice: first on the way, then restored.
    back = next(s for s, t, _ in histories.seen if t > s)
    first, restored = [h for s, _, h in histories.seen if s == back][:2]
    assert restored == first
    assert len(restored["grad_norm"]["norms"]) == back, "never emptied"
    # The norm baseline at the end: the last applied updates' norms, none of the dropped ones.
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    applied = [m["grad_norm"] for m in metrics if not m["optimizer_skipped"]]
    assert histories.seen[-1][2]["grad_norm"]["norms"] == applied[-101:-1]
    assert sum(m["optimizer_skipped"] for m in metrics) == 1 + 10, "the NaN step and 10 skipped"
    explosions = [a for a in anomalies if a["kind"] == "grad_norm_explosion"]
    assert explosions == []
