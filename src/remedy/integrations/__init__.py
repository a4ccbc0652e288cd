"""remedy where people already train: callbacks for Hugging Face and Lightning trainers.

Import the one you need; each needs its extra (`remedy[hf]`, `remedy[lightning]`):

    from remedy.integrations.hf import RemedyCallback         # transformers.Trainer
    from remedy.integrations.lightning import RemedyCallback  # lightning.Trainer

Both run on `LoopGuard`, the Guard's detectors and in-process actions for a
loop that the framework drives.
"""

from remedy.integrations._loop import LoopGuard

__all__ = ["LoopGuard"]
