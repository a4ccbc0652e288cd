"""Record the per-step losses of clean runs of the tiny example model (regression data).

    python tests/workers/data/record_clean_losses.py   # ~1 min on one core

Writes clean_losses.json next to this file: for each variant (data seed,
gradient clipping, AdamW beta2) the loss of each of 2000 plain (unguarded)
training steps, rounded to 5 decimals. These are the variants whose natural
per-batch loss tails once looked like spikes to `LossSpikeDetector`;
tests/workers/test_detectors.py replays them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from examples.gpt_model import (  # noqa: E402
    GPT,
    GPTConfig,
    SyntheticCorpus,
    cosine_with_warmup,
    lm_loss,
)

VARIANTS = [  # (data seed, clip, beta2)
    (0, 1.0, 0.95),
    (0, None, 0.999),
    (0, None, 0.95),
    (3, None, 0.95),
]
STEPS = 2000


def record(seed: int, clip: float | None, beta2: float) -> list[float]:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=2, n_embd=64, block_size=32))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, beta2))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_with_warmup(30, STEPS))
    corpus = SyntheticCorpus(block_size=32, batch_size=8, seed=seed)
    out = []
    for i in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model, corpus.batch(i))
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        out.append(round(loss.item(), 5))
    return out


def main() -> None:
    torch.set_num_threads(1)
    data = {f"seed={s} clip={c} beta2={b}": record(s, c, b) for s, c, b in VARIANTS}
    path = Path(__file__).with_name("clean_losses.json")
    path.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
