"""Chaos files validate like policies; faults fire at their step and rank, once per run or per poisoned batch."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.gpt_model import GPT, GPTConfig, SyntheticCorpus, lm_loss
from remedy.rank import Command, Guard, GuardConfig, WorkerContext
from remedy.rank.chaos import bitflips
from remedy.rank.chaos.faults import FAULT_DESCRIPTIONS, FaultInjector, load_chaos, parse_chaos
from remedy.rank.exceptions import ChaosConfigError
from remedy.rundir.writer import read_jsonl

# Tiny models: one intra-op thread (every bitwise comparison is within one test's process).
pytestmark = pytest.mark.usefixtures("one_torch_thread")

BROKEN = Path(__file__).resolve().parent / "chaos_broken"
REPO = Path(__file__).resolve().parents[2]


def test_load_demo_chaos_file() -> None:
    """The demo's chaos file loads into two faults."""
    faults = load_chaos(Path(__file__).resolve().parents[2] / "examples" / "chaos" / "demo.yaml")
    assert [f.kind for f in faults] == ["nan_loss", "loss_spike"]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"faults": [{"kind": "nan_lose", "at_step": 1}]}, "faults.0.kind"),
        ({"faults": [{"kind": "nan_loss"}]}, "at_step"),
        ({"faults": [{"kind": "nan_loss", "at_step": -1}]}, "at_step"),
        ({"faults": [{"kind": "nan_loss", "at_step": 1, "colour": "red"}]}, "colour"),
        ({"fault": []}, "fault"),
        ({"faults": [{"kind": "slow_loader", "at_step": 3, "seconds": math.inf}]}, "finite"),
    ],
)
def test_bad_chaos_is_rejected_by_name(data: object, message: str) -> None:
    """A malformed chaos plan raises ChaosConfigError naming the bad entry."""
    with pytest.raises(ChaosConfigError, match=message):
        parse_chaos(data)


def test_nan_loss_fires_once_on_its_rank() -> None:
    """nan_loss hits only its rank and only the first execution of its step."""
    faults = parse_chaos({"faults": [{"kind": "nan_loss", "at_step": 5, "rank": 1}]})
    other, hit = FaultInjector(faults, rank=0), FaultInjector(faults, rank=1)
    loss = torch.tensor(2.0)
    assert float(other.on_loss(5, 5, loss)) == 2.0
    assert math.isnan(float(hit.on_loss(5, 5, loss)))
    assert float(hit.on_loss(5, 5, loss)) == 2.0  # replay after a rollback is clean


def test_loss_spike_poisons_batches() -> None:
    """A spike poisons the batches it hits; they spike again whenever retrained, others never."""
    inj = FaultInjector(
        parse_chaos(
            {"faults": [{"kind": "loss_spike", "at_step": 10, "duration": 2, "factor": 4}]}
        ),
        0,
    )
    loss = torch.tensor(1.0)
    assert float(inj.on_loss(9, 9, loss)) == 1.0
    assert float(inj.on_loss(10, 10, loss)) == 4.0
    assert float(inj.on_loss(11, 11, loss)) == 4.0
    assert inj.poisoned_batches == [10, 11]
    # After a rollback, steps 10 and 11 read other batches (10 and 11 were skipped).
    assert float(inj.on_loss(10, 40, loss)) == 1.0
    assert float(inj.on_loss(12, 10, loss)) == 4.0


def test_grad_faults() -> None:
    """nan_grad puts a NaN in one gradient; grad_explosion scales the step's gradients in backward."""
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    inj = FaultInjector(
        parse_chaos(
            {
                "faults": [
                    {"kind": "nan_grad", "at_step": 1},
                    {"kind": "grad_explosion", "at_step": 2, "factor": 100},
                ]
            }
        ),
        0,
    )
    inj.on_grads(1, [p])
    assert math.isnan(float(p.grad[0]))
    p.grad = None
    inj.on_grads(2, [p])
    loss = inj.on_loss(2, 0, (p * 1.0).sum())
    assert float(loss) == 3.0, "the loss reads the same"
    loss.backward()
    assert p.grad is not None
    assert torch.equal(p.grad, torch.full((3,), 100.0))


def test_oom_fault_raises_out_of_memory() -> None:
    """The oom fault raises torch.OutOfMemoryError once."""
    inj = FaultInjector(parse_chaos({"faults": [{"kind": "oom", "at_step": 3}]}), 0)
    with pytest.raises(torch.OutOfMemoryError):
        inj.before_step(3)
    inj.before_step(3)


# (file under chaos_broken/, line, column, what the one error line says), loaded for a 1-rank run.
BROKEN_FILES = [
    ("not_utf8.yaml", 2, 44, "not UTF-8 text: byte 0xe9"),
    ("duplicate_key.yaml", 4, 5, 'duplicate key "at_step"'),
    ("yaml_tag.yaml", 3, 14, "YAML tags are not allowed in chaos files"),
    ("syntax_error.yaml", 3, 1, "YAML syntax: expected ',' or '}'"),
    ("deep_nesting.yaml", 1, 24, "nested deeper than 16 levels"),
    ("alias_bomb.yaml", 2, 8, "YAML aliases are not allowed in chaos files"),
    ("rank_outside_world.yaml", 2, 40, "rank 7 is outside the world of 1 (rank 0)"),
    ("rank_bool.yaml", 2, 40, "faults.0.rank: must be an integer, got True"),
    ("seconds_inf.yaml", 4, 14, "faults.0.seconds: must be a finite number, got inf"),
    ("leak_100tb.yaml", 4, 12, "faults.0.bytes: must be at most 17179869184"),
    ("leak_total.yaml", 2, 5, "at most 1099511627776 (1 TiB)"),
    ("unknown_kind.yaml", 2, 12, "faults.0.kind: unknown fault 'nan_lose'; one of: "),
    ("param_not_taken.yaml", 2, 34, "nan_loss does not take 'seconds'; it takes: at_step, rank"),
    ("negative_step.yaml", 2, 31, "faults.0.at_step: must be at least 0, got -1"),
    ("step_as_text.yaml", 2, 31, "faults.0.at_step: must be an integer, got '5'"),
    ("factor_nan.yaml", 2, 48, "faults.0.factor: must be a finite number, got nan"),
    ("factor_zero.yaml", 2, 48, "faults.0.factor: must be greater than 0"),
    ("duration_zero.yaml", 2, 46, "faults.0.duration: must be at least 1, got 0"),
    ("missing_step.yaml", 2, 5, "faults.0.at_step: missing required key"),
    ("top_level_list.yaml", 1, 1, "a chaos file is a mapping with a `faults:` list"),
    ("unknown_top_key.yaml", 2, 1, "fault: unknown key"),
    ("faults_not_list.yaml", 1, 9, "faults: expected a list of faults"),
    ("fault_not_mapping.yaml", 2, 5, "faults.0: expected a mapping"),
    ("bit_too_high.yaml", 2, 47, "faults.0.bit: must be at most 63, got 64"),
    (
        "target_unknown.yaml",
        4,
        13,
        "faults.0.target: must be one of 'param', 'grad' or 'activation'",
    ),
]


@pytest.mark.parametrize(
    ("name", "line", "col", "text"), BROKEN_FILES, ids=[b[0] for b in BROKEN_FILES]
)
def test_broken_chaos_file_gives_one_located_line(
    name: str, line: int, col: int, text: str
) -> None:
    """Each broken chaos file is refused with exactly one `FILE:LINE:COL: error: ...` line."""
    path = BROKEN / name
    with pytest.raises(ChaosConfigError) as info:
        load_chaos(path, world_size=1)
    (message,) = str(info.value).splitlines()
    assert message.startswith(f"{path}:{line}:{col}: error: "), message
    assert text in message


def test_every_broken_file_is_tested() -> None:
    """The table above covers every file in chaos_broken/."""
    assert sorted(p.name for p in BROKEN.iterdir()) == sorted(b[0] for b in BROKEN_FILES)


def test_unknown_kind_lists_only_injectable_faults() -> None:
    """The unknown-kind message offers exactly the faults this version can inject."""
    with pytest.raises(ChaosConfigError) as info:
        load_chaos(BROKEN / "unknown_kind.yaml")
    offered = str(info.value).split("one of: ")[1].split(", ")
    assert offered == sorted(FAULT_DESCRIPTIONS)


def test_unreadable_chaos_file(tmp_path: Path) -> None:
    """A missing file or a directory is one located line, not a traceback."""
    for path in (tmp_path / "missing.yaml", tmp_path):
        with pytest.raises(ChaosConfigError, match=rf"^{path}:1:1: error: cannot read chaos file"):
            load_chaos(path)


def test_every_error_of_a_file_is_reported(tmp_path: Path) -> None:
    """Several bad faults give one line each, in file order; a good fault among them is not an error."""
    path = tmp_path / "c.yaml"
    path.write_text(
        "faults:\n"
        "  - {kind: nan_loss, at_step: -1}\n"
        "  - {kind: nan_loss, at_step: 3}\n"
        "  - {kind: oom, at_step: 4, rank: 2}\n"
    )
    with pytest.raises(ChaosConfigError) as info:
        load_chaos(path, world_size=2)
    lines = str(info.value).splitlines()
    assert [line.split(": error: ")[0] for line in lines] == [f"{path}:2:31", f"{path}:4:35"]


def test_rank_check_needs_the_world_size(tmp_path: Path) -> None:
    """Without a world size the rank is not checked (compatible default); with one it is."""
    path = BROKEN / "rank_outside_world.yaml"
    assert [f.rank for f in load_chaos(path)] == [7]
    assert [f.rank for f in load_chaos(path, world_size=8)] == [7]


def test_empty_chaos_file_has_no_faults(tmp_path: Path) -> None:
    """An empty file, or `faults:` with nothing, schedules nothing."""
    for text in ("", "faults:\n", "faults: []\n"):
        path = tmp_path / "c.yaml"
        path.write_text(text)
        assert load_chaos(path, world_size=1) == []


# ------------------------------------------------------------ poisoned batches
CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16)
QUIET_POLICY = "version: 1\nname: quiet\nrules:\n  - name: ecc\n    when: {anomaly: gpu_ecc}\n    do: [notify]\n"


def spiked_guard(tmp_path: Path, faults: list[dict[str, Any]]) -> Guard:
    """A tiny real training job whose policy never acts, so only the test's commands do."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    corpus = SyntheticCorpus(vocab_size=32, block_size=16, batch_size=4, length=20_000, seed=0)
    policy = tmp_path / "quiet.yaml"
    policy.write_text(QUIET_POLICY)
    ctx = WorkerContext(run_dir=tmp_path / "run", faults=parse_chaos({"faults": faults}))
    config = GuardConfig(snapshot_every=5, checkpoint_every=0, policy=str(policy))
    return Guard(model, opt, loss_fn=lm_loss, data=corpus, max_steps=30, config=config, context=ctx)


def spikes(tmp_path: Path) -> list[tuple[int, int]]:
    """(step, batch index) of every spiked step, in the order trained."""
    return [
        (c["step"], c["batch_index"])
        for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")
        for c in m.get("chaos", [])
        if c["fault"] == "loss_spike"
    ]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("skip", [5, 0])
def test_poisoned_batches_follow_the_data_through_a_rollback(tmp_path: Path, skip: int) -> None:
    """A spike seen at its first step is rolled back: skipping the batches it named cures it,
    replaying them spikes again, and no fresh batch is ever poisoned."""
    spike = {"kind": "loss_spike", "at_step": 12, "duration": 3, "factor": 50.0}
    guard = spiked_guard(tmp_path, [spike])
    it = iter(guard)
    for _ in range(13):  # steps 0-12; step 12 trains the first poisoned batch
        guard.step(next(it))
    assert guard.injector.poisoned_batches == [12, 13, 14]
    (marker,) = (tmp_path / "run" / "chaos" / "fired").glob("loss_spike-*.json")
    assert json.loads(marker.read_text())["batches"] == [12, 15]
    guard.submit(
        Command("rb", "rollback", {"steps_back": 2, "skip_batches": skip}, 0, anomaly_step=12)
    )
    for batch in it:  # the boundary applies the rollback to step 10, then trains to the end
        guard.step(batch)
    guard.close()
    assert guard.history[0].outcome == "applied", guard.history[0].detail
    if skip:
        assert guard.history[0].result["skipped_batches"] == [10, 11, 12, 13, 14]
        assert spikes(tmp_path) == [(12, 12)]
    else:
        assert spikes(tmp_path) == [(12, 12), (12, 12), (13, 13), (14, 14)]


# ------------------------------------------------------ once per run, not per process
def test_faults_fire_once_per_run_across_injectors(tmp_path: Path) -> None:
    """A second injector on the same run directory (a replacement rank) does not fire again,
    and still sees the batches the first one poisoned."""
    faults = parse_chaos(
        {
            "faults": [
                {"kind": "nan_loss", "at_step": 5},
                {"kind": "oom", "at_step": 6},
                {"kind": "loss_spike", "at_step": 7, "duration": 2, "factor": 3},
            ]
        }
    )
    loss = torch.tensor(1.0)
    first = FaultInjector(faults, 0, run_dir=tmp_path)
    assert math.isnan(float(first.on_loss(5, 5, loss)))
    with pytest.raises(torch.OutOfMemoryError):
        first.before_step(6)
    assert float(first.on_loss(7, 7, loss)) == 3.0
    second = FaultInjector(faults, 0, run_dir=tmp_path)
    assert float(second.on_loss(5, 5, loss)) == 1.0
    second.before_step(6)
    assert second.poisoned_batches == [7, 8]
    assert float(second.on_loss(3, 8, loss)) == 3.0  # bad data, whatever step trains it
    assert float(second.on_loss(7, 20, loss)) == 1.0  # the fault fired already: no new poison
    # Another rank, or another run directory, has its own record.
    assert math.isnan(
        float(
            FaultInjector(
                parse_chaos({"faults": [{"kind": "nan_loss", "at_step": 5, "rank": None}]}),
                1,
                run_dir=tmp_path,
            ).on_loss(5, 5, loss)
        )
    )
    assert math.isnan(
        float(FaultInjector(faults, 0, run_dir=tmp_path / "other").on_loss(5, 5, loss))
    )


KILL = """
import sys
from remedy.rank.chaos.faults import FaultInjector, parse_chaos
faults = parse_chaos({"faults": [{"kind": "kill_rank", "at_step": 3}]})
injector = FaultInjector(faults, 0, run_dir=sys.argv[1])
for step in range(6):
    injector.before_step(step)
print("survived")
"""


@pytest.mark.timeout(120)
def test_kill_rank_does_not_kill_the_replacement(tmp_path: Path) -> None:
    """kill_rank ends the first process at its step; a replacement on the same run dir runs through."""
    run = [sys.executable, "-c", KILL, str(tmp_path)]
    first = subprocess.run(run, capture_output=True, text=True, cwd=REPO, check=False)
    assert first.returncode == -signal.SIGKILL and "survived" not in first.stdout
    second = subprocess.run(run, capture_output=True, text=True, cwd=REPO, check=False)
    assert second.returncode == 0 and "survived" in second.stdout, second.stderr


def _tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def test_bitflip_flips_one_bit_of_a_gradient_once() -> None:
    """Bit 30 of a float32 makes a small gradient huge, once; `index` and `name` choose the element."""
    model = _tiny()
    inj = FaultInjector(parse_chaos({"faults": [
        {"kind": "bitflip", "at_step": 3, "target": "grad", "name": "2.weight", "index": 5}]}), 0)  # fmt: skip
    inj.attach(model)
    seen = []
    for step in (2, 3, 3):  # the step before, the step, the step again (a replay)
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-3)
        inj.on_grads(step, list(model.parameters()))
        grad = model[2].weight.grad.view(-1)
        seen.append(grad[5].item())
        assert torch.equal(grad[:5], torch.full((5,), 1e-3))
    assert seen[0] == seen[2] == pytest.approx(1e-3) and seen[1] > 1e30
    assert [(e["fault"], e["name"], e["index"], e["bit"]) for e in inj.drain_log()] == [
        ("bitflip", "2.weight", 5, 30)
    ]
    assert model[0].weight.grad.eq(1e-3).all(), "other parameters untouched"


def test_a_weight_flip_of_a_low_bit_is_small_and_a_bad_rank_keeps_it_set() -> None:
    """target param: bitflip changes a weight by a few ulps; bad_rank sets the bit each step
    (it stays set, it does not flip back)."""
    model = _tiny()
    before = model[0].weight.view(-1)[0].item()
    inj = FaultInjector(parse_chaos({"faults": [
        {"kind": "bad_rank", "at_step": 1, "target": "param", "bit": 3}]}), 0)  # fmt: skip
    inj.attach(model)
    values = []
    for step in range(4):
        inj.after_update(step)
        values.append(model[0].weight.view(-1)[0].item())
    assert values[0] == before
    assert values[1] == values[2] == values[3] != before
    assert abs(values[1] - before) < 1e-5 * abs(before)


def test_an_activation_flip_corrupts_the_forward_output_on_its_step() -> None:
    """target activation: the module's output of that step's forward, on a copy; a NaN or a huge
    value downstream, and the next forward is clean again."""
    model = _tiny()
    x = torch.ones(2, 4)
    clean = model(x).detach()
    inj = FaultInjector(parse_chaos({"faults": [
        {"kind": "bitflip", "at_step": 1, "target": "activation", "name": "2"}]}), 0)  # fmt: skip
    inj.attach(model)
    inj.stepping(0)
    assert torch.equal(model(x).detach(), clean)
    inj.stepping(1)
    assert not torch.equal(model(x).detach(), clean)
    assert torch.equal(model(x).detach(), clean), "once"


def test_a_bad_rank_is_the_process_that_first_ran_the_step_not_its_replacement(
    tmp_path: Path,
) -> None:
    """The fired record names the bad process; a rank started after it (a replacement) is healthy."""
    faults = parse_chaos({"faults": [{"kind": "bad_rank", "at_step": 2, "rank": 1}]})
    bad = FaultInjector(faults, 1, run_dir=tmp_path)
    model = _tiny()
    bad.attach(model)
    assert [i for i, _, _ in bad._corrupting("grad", 2)] == [0]
    record = tmp_path / "chaos" / "fired" / f"{bad._keys[0]}.json"
    mark = json.loads(record.read_text())
    assert mark["process"] == bitflips.PROCESS
    # Another process of the same rank (its replacement) reads the mark and is not bad.
    mark["process"] = "4242-replacement"
    record.write_text(json.dumps(mark))
    replacement = FaultInjector(faults, 1, run_dir=tmp_path)
    replacement.attach(_tiny())
    assert list(replacement._corrupting("grad", 2)) == []
    assert [i for i, _, _ in bad._corrupting("grad", 3)] == [0], "the bad one stays bad"


def test_a_missing_parameter_or_module_is_named_when_the_guard_starts() -> None:
    """A chaos file naming what the model lacks fails at once, listing what it has."""
    model = _tiny()
    for fault, text in [
        ({"kind": "bitflip", "at_step": 1, "name": "head.weight"}, "no parameter 'head.weight'"),
        (
            {"kind": "bitflip", "at_step": 1, "target": "activation", "name": "enc"},
            "no module 'enc'",
        ),
    ]:
        ctx = WorkerContext(faults=parse_chaos({"faults": [fault]}))
        with pytest.raises(ChaosConfigError, match=text) as info:
            Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=lambda m, b: m(b).sum(),
                  data=[torch.ones(2, 4)], context=ctx)  # fmt: skip
        assert "0.weight" in str(info.value) or "0" in str(info.value)
