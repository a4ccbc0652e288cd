"""Memory remediations through a policy: OOM recovery, micro-batch reduction, KV allocator switch, CUDA settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from examples.gpt_model import GPT, GPTConfig, SyntheticCorpus, lm_loss
from remedy.rank import Command, Guard, GuardConfig
from remedy.rank.actions import inprocess as actions_mod
from remedy.rank.actions.activation_checkpointing import SavedActivationMeter, checkpointed_modules
from remedy.rank.actions.kv_cache import KVCache, KVLayout, generate, kv_fragmentation_event
from remedy.rundir.writer import read_jsonl

CFG = GPTConfig(vocab_size=32, block_size=32, n_layer=4, n_head=2, n_embd=32)

POLICY = """
version: 1
name: memory-test
rules:
  - name: oom-relief
    when: {anomaly: oom}
    do:
      - enable_activation_checkpointing: {fraction: 1.0}
      - reduce_microbatch: {factor: 2}
    max_fires: 4
  - name: kv-paged
    when: {anomaly: kv_fragmentation}
    do:
      - switch_kv_allocator: {to: paged}
    max_fires: 1
  - name: fragmentation
    when: {anomaly: memory_fragmentation}
    do:
      - configure_cuda_allocator: {expandable_segments: true}
"""


@pytest.fixture
def policy_file(tmp_path: Path) -> str:
    path = tmp_path / "memory.yaml"
    path.write_text(POLICY)
    return str(path)


def job(
    policy: str, run_dir: Path, *, max_steps: int, cap: int | None = None
) -> tuple[Guard, SyntheticCorpus]:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    corpus = SyntheticCorpus(vocab_size=32, block_size=32, batch_size=8, length=20_000)
    config = GuardConfig(policy=policy, activation_cap_bytes=cap, oom_wait_s=5.0)
    guard = Guard(
        model,
        opt,
        loss_fn=lm_loss,
        data=corpus,
        max_steps=max_steps,
        config=config,
        run_dir=run_dir,
    )
    return guard, corpus


def saved_bytes(model: torch.nn.Module, batch: torch.Tensor) -> int:
    with SavedActivationMeter() as meter:
        lm_loss(model, batch)
    return meter.peak


def test_oom_is_recovered_by_policy_and_no_step_is_lost(policy_file: str, tmp_path: Path) -> None:
    """A step over the memory cap raises OOM; the policy checkpoints and halves micro-batches; all steps complete."""
    probe, corpus = job(policy_file, tmp_path / "probe", max_steps=1)
    full = saved_bytes(probe.model, corpus.batch(0))
    probe.close()
    cap = int(full * 0.6)  # a full batch does not fit; a checkpointed half batch does
    guard, _ = job(policy_file, tmp_path / "run", max_steps=6, cap=cap)
    results = [guard.step(batch) for batch in guard]
    summary = guard.summary
    assert summary["status"] == "completed"
    assert summary["steps_completed"] == summary["steps_executed"] == 6, (
        "the OOM step was retried, not lost"
    )
    assert all(torch.isfinite(torch.tensor(r.loss)) for r in results)
    assert guard.micro_batches == 2
    assert len(checkpointed_modules(guard.model)) == CFG.n_layer
    anomalies = read_jsonl(tmp_path / "run" / "anomalies.jsonl")
    assert [a["kind"] for a in anomalies] == ["oom"]
    decisions = read_jsonl(tmp_path / "run" / "decisions.jsonl")
    assert [(d["action"], d["outcome"]) for d in decisions] == [
        ("enable_activation_checkpointing", "applied"),
        ("reduce_microbatch", "applied"),
    ]
    assert all(d["rule"] == "oom-relief" and d["reason"] for d in decisions)


def test_reduce_microbatch_keeps_loss_and_gradients(policy_file: str, tmp_path: Path) -> None:
    """Halving the micro-batch with accumulation gives the same loss and gradients (fp32, 1e-6)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    corpus = SyntheticCorpus(vocab_size=32, block_size=32, batch_size=8, length=20_000)
    batch = corpus.batch(3)
    loss = lm_loss(model, batch)
    loss.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    ref_loss = float(loss.detach())
    model.zero_grad(set_to_none=True)

    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    guard = Guard(
        model,
        opt,
        loss_fn=lm_loss,
        data=[batch] * 4,
        max_steps=4,
        config=GuardConfig(policy=policy_file),
    )
    guard.submit(Command("mb", "reduce_microbatch", {"factor": 4}, apply_at_step=0, anomaly_step=0))
    seen: list[list[torch.Tensor]] = []
    opt.step = lambda closure=None: seen.append([p.grad.clone() for p in model.parameters()])  # type: ignore[method-assign]
    it = iter(guard)
    result = guard.step(next(it))
    assert guard.micro_batches == 4
    assert result.loss == pytest.approx(ref_loss, abs=1e-6)
    for got, want in zip(seen[0], ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    guard.close()


def test_reduce_microbatch_cannot_split_below_one_sample(policy_file: str) -> None:
    """Splitting further than one sample per micro-batch fails with a reason."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(2, 4), torch.randn(2, 1))] * 5

    def loss_fn(m: torch.nn.Module, b: Any) -> torch.Tensor:
        return torch.nn.functional.mse_loss(m(b[0]), b[1])

    guard = Guard(
        model, opt, loss_fn=loss_fn, data=data, max_steps=5, config=GuardConfig(policy=policy_file)
    )
    it = iter(guard)
    guard.step(next(it))
    ok = actions_mod.apply_command(guard, Command("a", "reduce_microbatch", {"factor": 2}, 0, 0))
    bad = actions_mod.apply_command(guard, Command("b", "reduce_microbatch", {"factor": 2}, 0, 0))
    assert ok.outcome == "applied" and guard.micro_batches == 2
    assert bad.outcome == "failed" and "cannot split further" in bad.detail
    guard.close()


def test_kv_allocator_switch_migrates_a_live_cache(policy_file: str, tmp_path: Path) -> None:
    """A fragmented KV cache is reported, the policy switches to paged, and the live cache's tokens are unchanged."""
    guard, corpus = job(policy_file, tmp_path / "kv", max_steps=30)
    sampler = GPT(CFG).eval()  # a frozen copy generates while the Guard trains
    prompt = corpus.batch(999)[:1, :6]
    expected = generate(sampler, prompt, 20, allocator="fixed")
    cache = KVCache(KVLayout.for_model(sampler), 1, "fixed", max_tokens=26)
    guard.track_kv_cache(cache)
    out, step_in, pos = prompt, prompt, 0
    allocators = []
    for batch in guard:
        guard.step(batch)
        if out.shape[1] >= expected.shape[1]:
            continue
        # One generated token per training step, across step boundaries.
        with torch.no_grad():
            logits = sampler(step_in, cache=cache, start_pos=pos)[:, -1]
        pos += step_in.shape[1]
        step_in = logits.argmax(-1, keepdim=True)
        out = torch.cat([out, step_in], dim=1)
        allocators.append(cache.allocator)
        if len(allocators) == 3:
            guard.report_event(kv_fragmentation_event(cache, rank=0, step=guard.step_count))
    assert torch.equal(out, expected), "tokens changed across the allocator switch"
    assert allocators[0] == "fixed" and allocators[-1] == "paged"
    assert guard.kv_allocator == "paged"
    (decision,) = read_jsonl(tmp_path / "kv" / "decisions.jsonl")
    assert (decision["action"], decision["outcome"]) == ("switch_kv_allocator", "applied")
    assert decision["anomaly"]["kind"] == "kv_fragmentation"
    assert decision["result"]["migrated_caches"] == 1


def test_cuda_allocator_settings_fail_visibly_on_cpu(policy_file: str, tmp_path: Path) -> None:
    """On CPU, configure_cuda_allocator is journaled as failed with a reason, not dropped."""
    from remedy.policies import AnomalyEvent  # noqa: PLC0415 - only this test builds events by hand

    guard, _ = job(policy_file, tmp_path / "cuda", max_steps=5)
    it = iter(guard)
    guard.step(next(it))
    guard.report_event(
        AnomalyEvent(kind="memory_fragmentation", rank=0, step=1, value=0.5, threshold=0.3)
    )
    for batch in it:
        guard.step(batch)
    (decision,) = read_jsonl(tmp_path / "cuda" / "decisions.jsonl")
    assert decision["action"] == "configure_cuda_allocator"
    assert decision["outcome"] == "failed"
    assert "CUDA device" in decision["detail"]


@pytest.mark.gpu
def test_cuda_allocator_settings_apply_on_gpu(policy_file: str, tmp_path: Path) -> None:
    """With a GPU, expandable_segments is applied through the policy."""
    torch.manual_seed(0)
    model = GPT(CFG).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    corpus = SyntheticCorpus(vocab_size=32, block_size=32, batch_size=8, length=20_000)
    guard = Guard(
        model, opt, loss_fn=lm_loss, data=lambda i: corpus.batch(i).cuda(), max_steps=3,
        config=GuardConfig(policy=policy_file),
    )  # fmt: skip
    out = actions_mod.apply_command(
        guard, Command("c", "configure_cuda_allocator", {"expandable_segments": True}, 0, 0)
    )
    assert out.outcome == "applied", out.detail
    guard.close()
