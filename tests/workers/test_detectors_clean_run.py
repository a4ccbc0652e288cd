"""The whole default suite stays silent on a clean 2000-step run of the example (no false positives)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from examples.gpt_model import GPT, GPTConfig, SyntheticCorpus, cosine_with_warmup, lm_loss
from remedy.rank.detectors import default_detectors
from remedy.rank.detectors.testing import run_guarded

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_clean_example_run_raises_no_anomaly(tmp_path: Path) -> None:
    """2000 steps of the tiny example GPT (2 layers, width 64, 32 tokens, batch 8, warm-up and
    cosine LR) under a Guard with every default detector: zero events, and the loss fell."""
    steps = 2000
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=64, block_size=32))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_with_warmup(30, steps))  # type: ignore[arg-type]
    corpus = SyntheticCorpus(block_size=32, batch_size=8)
    detectors = default_detectors(model)
    run = run_guarded(
        model, opt, loss_fn=lm_loss, data=corpus.batch, steps=steps, scheduler=sched,
        detectors=detectors, policy_dir=tmp_path,
    )  # fmt: skip
    assert len(run.stats) == steps
    assert [(e.kind, e.step, e.value) for e in run.events] == []
    assert run.stats[-1].loss < 0.5 * run.stats[0].loss
