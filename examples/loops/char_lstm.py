"""A character-level LSTM language model on generated text: cosine LR, clipping, a DataLoader.

    remedy run examples/loops/char_lstm.py:main -- --epochs 8
    python examples/loops/char_lstm.py --run-dir runs/char_lstm

The text is sentences drawn from a tiny grammar, so the next character is
predictable within words and uncertain between them: the loss falls from
ln(vocabulary) to about one nat and then creeps down for a long time.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from loops_common import make_loader, parse_args, report, total_steps, wrap_ddp
from torch import nn
from torch.utils.data import Dataset

from remedy import Guard, GuardConfig

NOUNS = ["cat", "dog", "bird", "fish", "horse", "mouse", "tree", "river", "stone", "cloud"]
VERBS = ["sees", "chases", "likes", "finds", "follows", "hears", "eats", "knows"]
ADJECTIVES = ["small", "red", "quick", "old", "green", "quiet", "bright"]


def make_text(chars: int, seed: int) -> str:
    gen = torch.Generator().manual_seed(3000 + seed)

    def pick(words: list[str]) -> str:
        return words[int(torch.randint(0, len(words), (1,), generator=gen))]

    out: list[str] = []
    size = 0
    while size < chars:
        adjective = f"{pick(ADJECTIVES)} " if torch.rand(1, generator=gen) < 0.5 else ""
        sentence = f"the {adjective}{pick(NOUNS)} {pick(VERBS)} the {pick(NOUNS)}. "
        out.append(sentence)
        size += len(sentence)
    return "".join(out)[:chars]


class CharWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Windows of `length` characters at random offsets, and the same shifted by one."""

    def __init__(self, text: str, length: int, samples: int, seed: int) -> None:
        self.vocab = sorted(set(text))
        self.ids = torch.tensor([self.vocab.index(ch) for ch in text])
        gen = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(text) - length - 1, (samples,), generator=gen)
        self.length = length

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = int(self.starts[i])
        return self.ids[s : s + self.length], self.ids[s + 1 : s + self.length + 1]


class CharLSTM(nn.Module):
    def __init__(self, vocab: int, width: int = 48) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.lstm = nn.LSTM(16, width, batch_first=True)
        self.out = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(ids))
        return self.out(hidden)


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(
        __doc__.splitlines()[0], sys.argv[1:] if argv is None else argv,
        epochs=8, samples=2048, batch_size=16, lr=1e-2,
    )  # fmt: skip
    data = CharWindows(
        make_text(50_000, args.seed), length=32, samples=args.samples, seed=args.seed
    )
    torch.manual_seed(args.seed)
    model = wrap_ddp(CharLSTM(len(data.vocab)))
    loader = make_loader(data, args.batch_size, args.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=total_steps(loader, args.epochs, args.max_steps), eta_min=args.lr / 20
    )
    guard = Guard(
        model,
        optimizer,
        loss_fn=loss_fn,
        data=loader,
        epochs=args.epochs,
        max_steps=args.max_steps,
        scheduler=scheduler,
        config=GuardConfig(grad_clip=0.5, policy=args.policy),
        run_dir=args.run_dir,
    )
    for batch in guard:
        guard.step(batch)
    summary = guard.close()
    return report("char_lstm", summary, args.quiet, final_loss=summary["final_loss"])


if __name__ == "__main__":
    main()
