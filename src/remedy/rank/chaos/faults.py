"""Fault injection for chaos tests: faults scheduled by step and rank.

A chaos file is YAML: `faults: [{kind: nan_loss, at_step: 150, rank: 0}, ...]`.
Each fault perturbs the real training step (the loss, the gradients, the
loader, memory), so detection and remediation are exercised end to end.
Chaos files are validated like policies: `load_chaos` reports each problem
as one located line, `FILE:LINE:COL: error: ...`, before anything runs.

Two kinds of fault model two kinds of real trouble:
- transient faults (`nan_loss`, `nan_grad`, `grad_explosion`, `oom`,
  `kill_rank`, `kill_supervisor`, `kill_node`) fire once per run, the first time their step executes: a
  replay after a rollback, or in a replacement rank, is clean, as it is
  after a flipped bit or a one-off kernel error;
- data faults (`loss_spike`) poison batches: when the fault first fires it
  names the batch indices it poisons (the `duration` batches from the one
  trained at its step), and whenever one of those batches is trained on
  again, in this process or a replacement, the spike comes back. Only
  skipping those batches cures it, as with the bad-data spikes of large runs.
Window faults (`slow_loader`, `memory_leak`) act on every step of their
window each time it runs. Silent corruption (`bitflip` once, `bad_rank` on
every step of one rank's process until it is replaced) flips a bit of a
parameter, a gradient or an activation (`workers.bitflips`).

What has fired is kept in the run directory (`chaos_record.FiredRecord`), so
a restarted rank does not fire a fault again. To add a fault kind: name it in
`FaultKind`, describe it in `FAULT_DESCRIPTIONS` (which makes it injectable),
list its parameters in `FAULT_PARAMS`, and act on it from a `FaultInjector`
hook, with `FaultInjector.fire_once` for a fault that fires once per run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from remedy.policies import Diagnostic, PolicyError
from remedy.policies._yaml import Document, load_yaml
from remedy.rank.chaos import bitflips, process_faults
from remedy.rank.chaos.record import FiredRecord, fired_dir
from remedy.rank.exceptions import ChaosConfigError
from remedy.rank.state.sharding import local

FaultKind = Literal[
    "nan_loss",
    "nan_grad",
    "loss_spike",
    "grad_explosion",
    "scaler_overflow_storm",
    "memory_leak",
    "oom",
    "slow_loader",
    "hang_rank",
    "kill_rank",
    "slow_collective",
    "corrupt_checkpoint",
    "kill_supervisor",
    "bitflip",
    "bad_rank",
    "slow_rank",
    "checkpoint_write_error",
    "kill_node",
]
FAULT_KINDS: tuple[str, ...] = get_args(FaultKind)

# What each fault does, for `remedy chaos list`. Only the faults listed here
# can be injected by this version; a chaos file naming another is refused.
FAULT_DESCRIPTIONS: dict[str, str] = {
    "nan_loss": "the loss of one step becomes NaN (once per run; with `repeat` n, each of the "
    "first n times the step runs: a rollback runs it again, as a fault tied to the step would)",
    "nan_grad": "one parameter's gradient becomes NaN after backward (once per run)",
    "loss_spike": "poisons `duration` batches from the one trained at the step: their loss is "
    "scaled by `factor` every time they are trained on",
    "grad_explosion": "the gradients of one step are scaled by `factor` in its backward, before "
    "any all-reduce, as a real explosion is (once per run)",
    "memory_leak": "each step from `at_step` keeps `bytes` more memory alive for `duration` steps",
    "oom": "the step raises an out-of-memory error (once per run)",
    "slow_loader": "fetching each batch sleeps `seconds` for `duration` steps",
    "kill_rank": "the rank's process is killed (SIGKILL) at the start of the step (once per run); "
    "with `duration` n, each of its next n-1 replacements is killed too, as it joins the group, "
    "after the generation formed and before it adopts the state",
    "hang_rank": "the rank's process is stopped (SIGSTOP) at the start of the step (once per run)",
    "slow_collective": "the rank reaches its collectives after the step's backward `seconds` late "
    "(once per run)",
    "corrupt_checkpoint": "flips bytes in the rank's newest durable checkpoint payload at the "
    "boundary before the step (once per run); its checksum then fails on restore",
    "kill_supervisor": "the supervisor's process is killed (SIGKILL) from this rank at the start "
    "of the step (once per run); Ray restarts it and it resumes from its journal",
    "bitflip": "flips bit `bit` of element `index` of a parameter, a gradient or an activation "
    "(`target`, `name`) on the rank, once: a transient hardware fault",
    "bad_rank": "the same as bitflip on every step from `at_step`, on the rank's process until it "
    "is replaced (a parameter's bit stays set): a chip that keeps computing wrong results",
    "scaler_overflow_storm": "for `duration` steps the gradient entering backward is `factor` "
    "(1e10), past float16's range whatever the loss scale, so the float16 backward overflows and "
    "the real GradScaler skips step after step (once per run; needs an enabled GradScaler and "
    "float16 autocast)",
    "slow_rank": "a persistent straggler: the rank sleeps `seconds` inside every step of its "
    "`duration` steps, before its collectives",
    "checkpoint_write_error": "the next `duration` durable checkpoint writes from the step fail "
    "with a real EFBIG: the rank's file-size limit (RLIMIT_FSIZE) is 0 while it writes, so every "
    "retry fails and the store raises CheckpointError (once per run)",
    "kill_node": "the Ray node the rank runs on is killed (SIGKILL to its raylet and every process "
    "below it) at the start of the step (once per run); refused, and journaled, when the "
    "supervisor runs on that node",
}
SUPPORTED_FAULTS = frozenset(FAULT_DESCRIPTIONS)

# The anomaly kinds that show each fault, the one expected first: how `remedy chaos run`
# tells whether a fault was detected (a killed supervisor shows as its restart instead).
FAULT_SIGNS: dict[str, tuple[str, ...]] = {
    "nan_loss": ("nonfinite_loss",),
    "nan_grad": ("nonfinite_grad",),
    "loss_spike": ("loss_spike", "loss_divergence"),
    "grad_explosion": ("grad_norm_explosion", "nonfinite_grad"),
    "scaler_overflow_storm": ("scaler_overflow", "scaler_collapse"),
    "memory_leak": ("memory_growth", "memory_pressure", "oom"),
    "oom": ("oom",),
    "slow_loader": ("data_stall",),
    "hang_rank": ("rank_hang", "rank_dead"),
    "kill_rank": ("rank_dead", "rank_hang"),
    "slow_collective": ("collective_slow", "straggler", "rank_hang"),
    "corrupt_checkpoint": ("checkpoint_corrupt",),
    "kill_supervisor": (),
    "kill_node": ("node_lost", "rank_dead", "rank_hang"),
    "slow_rank": ("straggler", "collective_slow"),
    "checkpoint_write_error": ("checkpoint_write_failed",),
    # A flipped bit shows as whatever it does to the numbers, or not at all until the
    # replica check compares the ranks; a replay then classifies it.
    "bitflip": (
        "nonfinite_grad",
        "nonfinite_loss",
        "grad_norm_explosion",
        "loss_spike",
        "replica_divergence",
        "replay_transient",
        "replay_rank_specific",
    ),
    "bad_rank": (
        "nonfinite_grad",
        "nonfinite_loss",
        "grad_norm_explosion",
        "loss_spike",
        "replica_divergence",
        "replay_rank_specific",
        "replay_transient",
    ),
}

# Faults the framework callbacks cannot inject, and why (`remedy.integrations`): a chaos
# file naming one is refused there in one line rather than silently doing nothing.
NOT_UNDER_FRAMEWORKS: dict[str, str] = {
    "oom": "the framework's step has no out-of-memory retry to exercise",
    "corrupt_checkpoint": "the framework writes its own checkpoints",
    "slow_collective": "the framework runs its own collectives",
    "bitflip": "the corruption is injected in the Guard's own step",
    "bad_rank": "the corruption is injected in the Guard's own step",
    "checkpoint_write_error": "the framework writes its own checkpoints",
    "scaler_overflow_storm": "the framework steps its own GradScaler, so the storm's overflows "
    "cannot be checked",
}


def refuse_under_frameworks(faults: Iterable[Fault]) -> None:
    """Raise `ChaosConfigError` (one line) if a fault cannot be injected under a callback."""
    refused = sorted({f.kind for f in faults if f.kind in NOT_UNDER_FRAMEWORKS})
    if refused:
        why = "; ".join(f"{k}: {NOT_UNDER_FRAMEWORKS[k]}" for k in refused)
        raise ChaosConfigError(
            f"chaos: cannot inject {', '.join(refused)} under a framework callback ({why}); "
            "remove them from the chaos file or run the loop under a Guard"
        )


# The parameters each injectable fault takes, besides `kind`, `at_step` and `rank`.
FAULT_PARAMS: dict[str, frozenset[str]] = {
    "nan_loss": frozenset({"repeat"}),
    "nan_grad": frozenset(),
    "loss_spike": frozenset({"duration", "factor"}),
    "grad_explosion": frozenset({"factor"}),
    "memory_leak": frozenset({"duration", "bytes"}),
    "oom": frozenset(),
    "slow_loader": frozenset({"duration", "seconds"}),
    "kill_rank": frozenset({"duration"}),
    "hang_rank": frozenset(),
    "slow_collective": frozenset({"seconds"}),
    "corrupt_checkpoint": frozenset(),
    "kill_supervisor": frozenset(),
    "bitflip": frozenset({"target", "name", "index", "bit"}),
    "bad_rank": frozenset({"target", "name", "index", "bit"}),
    "scaler_overflow_storm": frozenset({"duration", "factor"}),
    "slow_rank": frozenset({"duration", "seconds"}),
    "checkpoint_write_error": frozenset({"duration"}),
    "kill_node": frozenset(),
}

# A kind not listed above takes any of them.
_ALL_PARAMS = frozenset(
    {"duration", "factor", "seconds", "bytes", "target", "name", "index", "bit", "repeat"}
)

# Bounds: a chaos file describes a test, and a value past these is a typo
# that would otherwise crash the rank with no reason given.
MAX_STEP = 10**12
MAX_DURATION = 10**9
MAX_SPIKE_BATCHES = 100_000  # batches one loss_spike may poison
MAX_SECONDS = 3600.0
MAX_FACTOR = 1e12
MAX_BYTES = 1 << 34  # 16 GiB kept alive per step
MAX_BIT = 63  # the widest element, float64 / int64
MAX_INDEX = 1 << 48
MAX_LEAK_BYTES = 1 << 40  # 1 TiB over a whole memory_leak
MAX_FILE_BYTES = 1 << 20
MAX_MESSAGES = 20  # located errors shown for one file
MAX_DEPTH = 16  # a chaos file is two levels deep
# The gradient a scaler_overflow_storm sends into backward: past float16's range (65504)
# however far the GradScaler backs its scale off, well inside float32's.
STORM_FACTOR = 1e10


class Fault(BaseModel):
    """One scheduled fault."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    kind: FaultKind
    at_step: int = Field(ge=0, le=MAX_STEP)
    rank: int | None = Field(default=0, ge=0, description="rank to hit; null means every rank")
    duration: int = Field(default=1, ge=1, le=MAX_DURATION)
    factor: float | None = Field(default=None, gt=0, le=MAX_FACTOR, allow_inf_nan=False)
    seconds: float = Field(default=0.5, ge=0, le=MAX_SECONDS, allow_inf_nan=False)
    bytes: int = Field(default=8 << 20, ge=0, le=MAX_BYTES)
    # bitflip, bad_rank (`workers.bitflips`): what is corrupted, where, which bit.
    target: Literal["param", "grad", "activation"] = "grad"
    name: str | None = Field(default=None, min_length=1, max_length=200)
    index: int = Field(default=0, ge=0, le=MAX_INDEX)
    bit: int = Field(default=30, ge=0, le=MAX_BIT)
    # nan_loss: how many times the step's loss is NaN, one per time the step runs.
    repeat: int = Field(default=1, ge=1, le=MAX_DURATION)
    # Where the fault was declared (`FILE:LINE:COL`), set by the loader, so a fault found
    # unable to fire later (in a rank) is reported at its line. Not part of its identity.
    source: str | None = None

    @model_validator(mode="after")
    def _bounded_totals(self) -> Fault:
        if self.kind == "memory_leak" and self.bytes * self.duration > MAX_LEAK_BYTES:
            raise ValueError(
                f"memory_leak keeps bytes x duration = {self.bytes * self.duration} bytes alive; "
                f"at most {MAX_LEAK_BYTES} (1 TiB)"
            )
        if self.kind == "loss_spike" and self.duration > MAX_SPIKE_BATCHES:
            raise ValueError(f"loss_spike poisons at most {MAX_SPIKE_BATCHES} batches (duration)")
        return self

    def hits(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank

    def key(self, rank: int) -> str:
        """A stable name for this fault hitting `rank`, the same in every process of the run."""
        # `repeat` at its default is left out: a fault's name is the same as before it existed.
        exclude = {"source"} if self.repeat != 1 else {"source", "repeat"}
        canon = json.dumps(self.model_dump(exclude=exclude), sort_keys=True)
        digest = hashlib.sha256(canon.encode()).hexdigest()[:12]
        return f"{self.kind}-s{self.at_step}-r{rank}-{digest}"


@dataclass(frozen=True)
class ChaosSetting:
    """What the faults will run under, as far as it is known (None: not known here).

    A fault that cannot fire in its setting is an error, never a silent no-op:
    `kill_supervisor` needs a supervisor, `corrupt_checkpoint` and
    `checkpoint_write_error` durable checkpoints, `scaler_overflow_storm` an
    enabled GradScaler, `slow_rank` peers to be slower than, and every
    rank-specific fault a rank inside the world.
    """

    world_size: int | None = None
    supervised: bool | None = None
    checkpoint_every: int | None = None  # 0: no durable checkpoints (or no run directory)
    scaler: bool | None = None  # an enabled GradScaler


def cannot_fire(fault: Fault, setting: ChaosSetting) -> str | None:
    """Why `fault` could never fire in `setting`, or None if it can (or it is not known)."""
    kind, world = fault.kind, setting.world_size
    if world is not None and fault.rank is not None and fault.rank >= world:
        ranks = "rank 0" if world == 1 else f"ranks 0-{world - 1}"
        return f"rank {fault.rank} is outside the world of {world} ({ranks}); the fault would never fire"
    if kind == "kill_supervisor" and setting.supervised is False:
        return (
            "kill_supervisor cannot fire here: there is no supervisor to kill (a Guard alone); "
            "run the loop under `remedy run`"
        )
    if kind == "kill_node" and setting.supervised is False:
        return (
            "kill_node cannot fire here: a Guard alone runs on no Ray node remedy watches; "
            "run the loop under `remedy run` on a cluster of several nodes"
        )
    if kind in ("corrupt_checkpoint", "checkpoint_write_error") and setting.checkpoint_every == 0:
        return (
            f"{kind} cannot fire here: this loop writes no durable checkpoints "
            "(checkpoint_every is 0, or there is no run directory)"
        )
    if kind == "scaler_overflow_storm" and setting.scaler is False:
        return (
            "scaler_overflow_storm cannot fire here: the loop has no enabled GradScaler "
            "(pass scaler=torch.amp.GradScaler(...) and GuardConfig(amp_dtype=torch.float16))"
        )
    if kind == "slow_rank" and world == 1:
        return "slow_rank needs at least 2 ranks: a straggler is slower than its peers, one rank has none"
    return None


def check_setting(faults: Iterable[Fault], setting: ChaosSetting) -> None:
    """Raise `ChaosConfigError`, one located line per fault that cannot fire in `setting`."""
    lines = []
    for f in faults:
        why = cannot_fire(f, setting)
        if why is not None:
            lines.append(f"{f.source or 'chaos'}: error: {f.kind} at step {f.at_step}: {why}")
    if lines:
        raise ChaosConfigError("\n".join(lines[:MAX_MESSAGES]))


@dataclass(frozen=True)
class Scenario:
    """A chaos file read whole: its faults and, for `remedy chaos run`, the job they hit.

    Keys besides `faults` (all optional): `description`, `target`
    (`file.py:function`), `workers`, `steps` (passed as `--steps N`), `args`
    (the target's other arguments), `policy`, `loss_tolerance` (the final loss
    may differ from the fault-free twin's by this fraction), and `random`, a
    seeded schedule of faults drawn at load time.
    """

    path: str
    faults: list[Fault]
    description: str = ""
    target: str | None = None
    workers: int | None = None
    steps: int | None = None
    args: tuple[str, ...] = ()
    policy: str | None = None
    loss_tolerance: float | None = None


_SCENARIO_KEYS = (
    "faults", "description", "target", "workers", "steps", "args", "policy",
    "loss_tolerance", "random",
)  # fmt: skip
MAX_WORKERS = 100_000
MAX_RANDOM_FAULTS = 1000


def load_chaos(
    path: str | os.PathLike[str],
    *,
    world_size: int | None = None,
    setting: ChaosSetting | None = None,
) -> list[Fault]:
    """Read and validate a chaos file; raise ChaosConfigError with one `FILE:LINE:COL: error:` line per problem.

    With `world_size` (or `setting.world_size`), a fault for a rank outside the
    world is an error too; with a `setting`, so is a fault that cannot fire in it.
    """
    return load_scenario(path, world_size=world_size, setting=setting).faults


def load_scenario(
    path: str | os.PathLike[str],
    *,
    world_size: int | None = None,
    setting: ChaosSetting | None = None,
) -> Scenario:
    """Read and validate a chaos file with the keys `remedy chaos run` reads (see `Scenario`)."""
    path = Path(path)
    name = str(path)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        message = f"cannot read chaos file: {exc.strerror or exc}"
        raise _error([Diagnostic(name, 1, 1, message)]) from None
    if len(raw) > MAX_FILE_BYTES:
        raise _error([Diagnostic(name, 1, 1, f"chaos file larger than {MAX_FILE_BYTES} bytes")])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        message = f"not UTF-8 text: byte 0x{raw[exc.start]:02x} cannot be decoded"
        raise _error([Diagnostic(name, line, col, message)]) from None
    early = _prescan(text, name)
    if early is not None:
        raise _error([early])
    try:
        doc = load_yaml(text, name)
    except PolicyError as exc:
        # The YAML reader is the policy language's; its words fit this file too.
        raise _error([_retitle(d) for d in exc.diagnostics]) from None
    except RecursionError:
        raise _error([Diagnostic(name, 1, 1, "YAML nested too deeply")]) from None
    return _validate(doc, _with_world(setting, world_size))


def _with_world(setting: ChaosSetting | None, world_size: int | None) -> ChaosSetting:
    setting = setting or ChaosSetting()
    if world_size is not None:
        setting = dataclasses.replace(setting, world_size=world_size)
    return setting


def _prescan(text: str, name: str) -> Diagnostic | None:
    """Refuse what a chaos file never needs before building any tree: aliases (an alias
    bomb expands exponentially) and deep nesting. Syntax errors are left to `load_yaml`."""
    depth = 0
    try:
        for event in YAML(typ="rt").parse(text):
            kind = type(event).__name__
            mark = event.start_mark
            if kind == "AliasEvent":
                return Diagnostic(
                    name,
                    mark.line + 1,
                    mark.column + 1,
                    "YAML aliases are not allowed in chaos files",
                )
            if kind in ("MappingStartEvent", "SequenceStartEvent"):
                depth += 1
                if depth > MAX_DEPTH:
                    message = f"nested deeper than {MAX_DEPTH} levels"
                    return Diagnostic(name, mark.line + 1, mark.column + 1, message)
            elif kind in ("MappingEndEvent", "SequenceEndEvent"):
                depth -= 1
    except (YAMLError, RecursionError):
        return None
    return None


def parse_chaos(
    data: Any,
    *,
    source: str = "<chaos>",
    world_size: int | None = None,
    setting: ChaosSetting | None = None,
) -> list[Fault]:
    """Validate chaos data already loaded (a dict); errors as in `load_chaos`, at 1:1."""
    return _validate(Document(source, data), _with_world(setting, world_size)).faults


def _validate(doc: Document, setting: ChaosSetting) -> Scenario:
    errors: list[Diagnostic] = []
    data = {} if doc.data is None else doc.data
    if not isinstance(data, Mapping):
        raise _error([doc.error((), "a chaos file is a mapping with a `faults:` list")])
    for key in data:
        if key not in _SCENARIO_KEYS:
            keys = ", ".join(_SCENARIO_KEYS)
            errors.append(
                doc.error((key,), f"{key}: unknown key; a chaos file has: {keys}", key=True)
            )
    entries = data.get("faults", [])
    if entries is None:
        entries = []
    if not isinstance(entries, list):
        errors.append(doc.error(("faults",), "faults: expected a list of faults"))
        entries = []
    fields = _scenario_fields(doc, data, errors)
    world = setting.world_size if setting.world_size is not None else fields.get("workers")
    setting = dataclasses.replace(setting, world_size=world)
    faults: list[Fault] = []
    for i, entry in enumerate(entries):
        fault = _fault(doc, ("faults", i), entry, setting, errors)
        if fault is not None:
            faults.append(fault)
    if "random" in data:
        faults.extend(_random_faults(doc, data["random"], setting, errors))
    if errors:
        raise _error(errors)
    return Scenario(path=doc.file, faults=faults, **fields)


def _scenario_fields(
    doc: Document, data: Mapping[str, Any], errors: list[Diagnostic]
) -> dict[str, Any]:
    """The keys `remedy chaos run` reads, checked; the wrong ones are errors."""
    out: dict[str, Any] = {}
    for key in ("description", "target", "policy"):
        value = data.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or not value.strip() or "\x00" in value:
            errors.append(doc.error((key,), f"{key}: expected a non-empty string"))
        else:
            out[key] = value
    for key, top in (("workers", MAX_WORKERS), ("steps", MAX_STEP)):
        value = data.get(key)
        if value is None:
            continue
        if type(value) is not int or not 1 <= value <= top:
            errors.append(
                doc.error((key,), f"{key}: expected a whole number from 1 to {top}, got {value!r}")
            )
        else:
            out[key] = value
    args = data.get("args")
    if args is not None:
        if not isinstance(args, list) or not all(
            isinstance(a, str | int | float) and not isinstance(a, bool) for a in args
        ):
            errors.append(
                doc.error(
                    ("args",),
                    "args: expected a list of the target's arguments (strings or numbers)",
                )
            )
        else:
            out["args"] = tuple(str(a) for a in args)
    tolerance = data.get("loss_tolerance")
    if tolerance is not None:
        if (
            not isinstance(tolerance, int | float)
            or isinstance(tolerance, bool)
            or not 0 <= tolerance <= 10
        ):
            errors.append(
                doc.error(
                    ("loss_tolerance",),
                    f"loss_tolerance: expected a fraction from 0 to 10, got {tolerance!r}",
                )
            )
        else:
            out["loss_tolerance"] = float(tolerance)
    return out


def _random_faults(
    doc: Document, spec: Any, setting: ChaosSetting, errors: list[Diagnostic]
) -> list[Fault]:
    """A seeded random schedule: `{seed, rate, from_step, until_step, mix: {kind: weight}}`.

    Each step of [from_step, until_step) gets a fault with probability `rate`,
    its kind drawn by weight from `mix` and its rank uniformly from the world
    (rank 0 when the world is not known); the same seed gives the same faults.
    """
    where = ("random",)
    if not isinstance(spec, Mapping):
        errors.append(
            doc.error(where, "random: expected a mapping {seed, rate, from_step, until_step, mix}")
        )
        return []
    allowed = {"seed", "rate", "from_step", "until_step", "mix"}
    for key in spec:
        if key not in allowed:
            errors.append(
                doc.error(
                    (*where, key),
                    f"random.{key}: unknown key; it takes: {', '.join(sorted(allowed))}",
                    key=True,
                )
            )
    seed, rate = spec.get("seed", 0), spec.get("rate")
    first, until = spec.get("from_step", 0), spec.get("until_step")
    mix = spec.get("mix")
    bad = len(errors)
    if type(seed) is not int:
        errors.append(
            doc.error((*where, "seed"), f"random.seed: expected an integer, got {seed!r}")
        )
    if not isinstance(rate, int | float) or isinstance(rate, bool) or not 0 < rate <= 1:
        errors.append(
            doc.error(
                (*where, "rate"), f"random.rate: expected faults per step in (0, 1], got {rate!r}"
            )
        )
    if type(first) is not int or first < 0:
        errors.append(
            doc.error(
                (*where, "from_step"), f"random.from_step: expected a step from 0, got {first!r}"
            )
        )
    if type(until) is not int or (type(first) is int and until <= first) or until > MAX_STEP:
        errors.append(
            doc.error(
                (*where, "until_step"),
                f"random.until_step: expected a step after from_step, got {until!r}",
            )
        )
    if not isinstance(mix, Mapping) or not mix:
        errors.append(
            doc.error((*where, "mix"), "random.mix: expected a mapping of fault kinds to weights")
        )
        mix = {}
    for kind, weight in mix.items():
        if kind not in SUPPORTED_FAULTS:
            errors.append(
                doc.error(
                    (*where, "mix", kind),
                    f"random.mix: unknown or not injectable fault {kind!r}; "
                    f"one of: {', '.join(sorted(SUPPORTED_FAULTS))}",
                    key=True,
                )
            )
        elif (
            not isinstance(weight, int | float) or isinstance(weight, bool) or not 0 < weight <= 1e6
        ):
            errors.append(
                doc.error(
                    (*where, "mix", kind),
                    f"random.mix.{kind}: expected a weight in (0, 1e6], got {weight!r}",
                )
            )
    if len(errors) > bad or not isinstance(until, int) or not isinstance(rate, int | float):
        return []
    rng = random.Random(seed)
    kinds = sorted(mix)
    weights = [float(mix[k]) for k in kinds]
    world = setting.world_size or 1
    line, col = doc.locate(where, key=True)
    source = f"{doc.file}:{line}:{col}"
    faults = []
    for step in range(first, until):
        if rng.random() >= rate:
            continue
        kind = rng.choices(kinds, weights)[0]
        fault = Fault(kind=kind, at_step=step, rank=rng.randrange(world), source=source)
        why = cannot_fire(fault, setting)
        if why is not None:
            errors.append(doc.error(where, f"random: {kind} at step {step}: {why}", key=True))
            return []
        faults.append(fault)
        if len(faults) > MAX_RANDOM_FAULTS:
            errors.append(
                doc.error(
                    where, f"random: more than {MAX_RANDOM_FAULTS} faults; lower rate or the span"
                )
            )
            return []
    return faults


def _fault(
    doc: Document,
    where: tuple[str, int],
    entry: Any,
    setting: ChaosSetting,
    errors: list[Diagnostic],
) -> Fault | None:
    label = f"faults.{where[1]}"
    if not isinstance(entry, Mapping):
        errors.append(
            doc.error(where, f"{label}: expected a mapping like {{kind: nan_loss, at_step: 10}}")
        )
        return None
    kind = entry.get("kind")
    injectable = ", ".join(sorted(SUPPORTED_FAULTS))
    if "kind" not in entry:
        errors.append(
            doc.error(where, f"{label}: missing required key 'kind'; one of: {injectable}")
        )
        return None
    if not isinstance(kind, str) or kind not in FAULT_KINDS:
        errors.append(
            doc.error(
                (*where, "kind"), f"{label}.kind: unknown fault {kind!r}; one of: {injectable}"
            )
        )
        return None
    if kind not in SUPPORTED_FAULTS:
        errors.append(
            doc.error(
                (*where, "kind"),
                f"{label}.kind: fault {kind!r} cannot be injected by this version; "
                f"injectable: {injectable}",
            )
        )
        return None
    allowed = {"kind", "at_step", "rank"} | FAULT_PARAMS.get(kind, _ALL_PARAMS)
    bad = [k for k in entry if k not in allowed]
    for key in bad:
        takes = ", ".join(sorted(allowed - {"kind"}))
        errors.append(
            doc.error(
                (*where, str(key)),
                f"{label}.{key}: {kind} does not take {key!r}; it takes: {takes}",
                key=True,
            )
        )
    if bad:
        return None
    line, col = doc.locate(where)
    try:
        fault = Fault.model_validate({**entry, "source": f"{doc.file}:{line}:{col}"})
    except ValidationError as exc:
        for detail in exc.errors(include_url=False):
            loc = tuple(detail["loc"])
            field = ".".join(str(p) for p in (label, *loc))
            errors.append(doc.error((*where, *loc), f"{field}: {_text(detail)}"))
        return None
    why = cannot_fire(fault, setting)
    if why is not None:
        at = (*where, "rank") if why.startswith("rank ") else (*where, "kind")
        errors.append(doc.error(at, f"{label}.{at[-1]}: {why}"))
        return None
    return fault


def _text(detail: Any) -> str:
    """A short reason for one pydantic error."""
    kind, ctx = detail["type"], detail.get("ctx") or {}
    got = repr(detail.get("input"))
    got = got if len(got) <= 40 else got[:37] + "..."
    texts = {
        "missing": "missing required key",
        "finite_number": f"must be a finite number, got {got}",
        "int_type": f"must be an integer, got {got}",
        "float_type": f"must be a number, got {got}",
        "less_than_equal": f"must be at most {ctx.get('le')}, got {got}",
        "greater_than": f"must be greater than {ctx.get('gt')}, got {got}",
        "greater_than_equal": f"must be at least {ctx.get('ge')}, got {got}",
        "literal_error": f"must be one of {ctx.get('expected')}, got {got}",
        "string_type": f"must be a string, got {got}",
    }
    return texts.get(kind) or str(detail["msg"]).removeprefix("Value error, ")


def _retitle(d: Diagnostic) -> Diagnostic:
    message = d.message.replace("policy file", "chaos file")
    return Diagnostic(d.file, d.line, d.col, message, d.severity)


def _error(diagnostics: list[Diagnostic]) -> ChaosConfigError:
    lines = [d.format() for d in diagnostics[:MAX_MESSAGES]]
    if len(diagnostics) > MAX_MESSAGES:
        lines.append(f"... and {len(diagnostics) - MAX_MESSAGES} more errors")
    return ChaosConfigError("\n".join(lines))


def corrupt_file(path: Path, count: int = 16) -> None:
    """Flip `count` bytes in the middle of `path` in place, as bit rot on disk does."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, min(middle + count, len(data))):
        data[i] ^= 0xFF
    with open(path, "r+b") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


class FaultInjector:
    """Applies the faults scheduled for one rank to the running step.

    `run_dir`: the run directory whose fired-fault record this rank shares
    with the run's other processes (None: a record in memory only).
    """

    def __init__(
        self,
        faults: Iterable[Fault],
        rank: int,
        *,
        run_dir: str | os.PathLike[str] | None = None,
        kill_supervisor: Callable[[], None] | None = None,
        kill_node: Callable[[], str] | None = None,
    ) -> None:
        self.rank = rank
        # How this rank kills its supervisor (`RayReporter.kill_supervisor`); None alone.
        self._kill_supervisor = kill_supervisor
        # How it kills its node (`RayReporter.kill_node`: returns only when it refuses, saying why).
        self._kill_node = kill_node
        self.faults = [f for f in faults if f.hits(rank)]
        self._keys = [f.key(rank) for f in self.faults]
        self.record = FiredRecord(fired_dir(run_dir))
        # A scaler_overflow_storm under way: (the tick it ends before, its gradient factor).
        self._storm: tuple[int, float] | None = None
        self.storm_steps = 0  # storm steps run so far, checked against the scaler's skips
        self._tick = 0
        # Poisoned batches, as (first, end, loss factor): a property of the data,
        # so they are read back from faults that fired in an earlier process.
        self._poisoned: list[tuple[int, int, float]] = []
        for f, key in zip(self.faults, self._keys, strict=True):
            if f.kind == "loss_spike":
                fired = self.record.get(key)
                if fired is not None:
                    self._poison(fired)
        self._leak: list[torch.Tensor] = []
        self.log: list[dict[str, Any]] = []  # what was injected, for the metrics stream
        # Silent corruption (`attach`): the tensors each bitflip/bad_rank fault aims at.
        self._aims: dict[int, tuple[str, torch.Tensor | None]] = {}
        self._bad: dict[int, bool] = {}  # bad_rank: is this process the bad one
        self._step = 0  # the step being run (for forward hooks)
        self._factor_override: tuple[float | None] | None = None  # see `data_factor_of`

    def attach(self, model: torch.nn.Module) -> None:
        """Aim the silent-corruption faults at the model's tensors (raises `ChaosConfigError`
        naming what the model lacks): forward hooks for activations."""
        for i, f in enumerate(self.faults):
            if f.kind not in ("bitflip", "bad_rank"):
                continue
            if f.target == "activation":
                name, module = bitflips.find_module(model, f.name)
                module.register_forward_hook(self._activation_hook(i, f))
                self._aims[i] = (name, None)
            else:
                name, param = bitflips.find_parameter(model, f.name)
                self._aims[i] = (name, param)

    def stepping(self, step: int) -> None:
        """The step whose forward runs next (a replay runs an earlier one again)."""
        self._step = step

    def _corrupting(self, target: str, step: int) -> Iterator[tuple[int, Fault, bool]]:
        """(index, fault, stuck) of each bitflip/bad_rank fault of `target` due at `step`."""
        for i, f in enumerate(self.faults):
            if f.kind in ("bitflip", "bad_rank") and f.target == target and i in self._aims:
                stuck = self._due(i, step)
                if stuck is not None:
                    yield i, f, stuck

    def _due(self, i: int, step: int) -> bool | None:
        """Whether silent-corruption fault `i` acts at `step` (None: not), and if so whether the
        bit stays set (a bad_rank's weight) rather than flipping. A bitflip is marked fired."""
        f = self.faults[i]
        if f.kind == "bad_rank":
            return (f.target == "param") if step >= f.at_step and self._is_bad(i, step) else None
        if f.at_step != step or self.record.get(self._keys[i]) is not None:
            return None
        self.record.mark(self._keys[i], {"kind": f.kind, "rank": self.rank, "step": step})
        return False

    def _is_bad(self, i: int, step: int) -> bool:
        """bad_rank: the first process of the rank to reach the step is bad, for good; the ones
        that replace it are not."""
        if i not in self._bad:
            fired = self.record.get(self._keys[i])
            if fired is None:
                fired = {"kind": "bad_rank", "rank": self.rank, "step": step,
                         "process": bitflips.PROCESS}  # fmt: skip
                self.record.mark(self._keys[i], fired)
            self._bad[i] = fired.get("process") == bitflips.PROCESS
        return self._bad[i]

    def _activation_hook(self, i: int, f: Fault) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
            del module, args
            if self._due(i, self._step) is None:
                return None
            changed, done = bitflips.corrupt_output(output, f.index, f.bit)
            self._note(f.kind, self._step, target="activation", name=self._aims[i][0], **done)
            return changed

        return hook

    def after_update(self, step: int) -> None:
        """Parameter faults, after the optimizer step: a flipped (or stuck) bit of a weight."""
        for i, f, stuck in self._corrupting("param", step):
            name, param = self._aims[i]
            assert param is not None
            with torch.no_grad():
                done = bitflips.flip_bit(param, f.index, f.bit, stuck=stuck)
            self._note(f.kind, step, target="param", name=name, **done)

    def data_factor(self, batch_index: int) -> float | None:
        """The loss factor a poisoned batch carries (None for a clean one)."""
        return self._factor(batch_index)

    @contextlib.contextmanager
    def data_factor_of(self, factor: float | None) -> Iterator[None]:
        """Within: the batch being run carries `factor` (another rank's batch, poison and all),
        whatever this rank's own poisoned batches are."""
        self._factor_override = (factor,)
        try:
            yield
        finally:
            self._factor_override = None

    def _window(self, kind: str, step: int) -> list[tuple[int, Fault]]:
        if not self.faults:  # the common case: every hook is a no-op
            return []
        return [
            (i, f)
            for i, f in enumerate(self.faults)
            if f.kind == kind and f.at_step <= step < f.at_step + f.duration
        ]

    def fire_once(self, kind: str, step: int, **info: Any) -> Fault | None:
        """The first fault of `kind` due at `step` that has not fired in this run, now marked fired.

        The mark is on disk before this returns (with a run directory), so a
        fault that ends the process is not fired again by its replacement.
        `info` is kept in the mark.
        """
        for i, f in self._window(kind, step):
            if self.record.get(self._keys[i]) is None:
                self.record.mark(
                    self._keys[i], {"kind": kind, "rank": self.rank, "step": step, **info}
                )
                return f
        return None

    def _fire_repeated(self, kind: str, step: int) -> Fault | None:
        """`fire_once` for a fault with `repeat`: it fires each of the first `repeat` times its
        step runs (the record counts them: `times`)."""
        for i, f in self._window(kind, step):
            fired = self.record.get(self._keys[i])
            times = 0 if fired is None else fired.get("times", 1)
            times = times if type(times) is int else f.repeat
            if times < f.repeat:
                self.record.mark(
                    self._keys[i],
                    {"kind": kind, "rank": self.rank, "step": step, "times": times + 1},
                )
                return f
        return None

    def not_reached(self, steps: int) -> list[str]:
        """The faults of this rank that never fired because the run ended before their step
        (`steps`: the steps it completed), in words, for the warning at its end."""
        return [
            f"{f.kind} at step {f.at_step} (rank {self.rank}): the run ended after step "
            f"{steps - 1}, so it never fired"
            for f, key in zip(self.faults, self._keys, strict=True)
            if f.at_step >= steps and self.record.get(key) is None
        ]

    def _note(self, kind: str, step: int, **info: Any) -> None:
        self.log.append({"fault": kind, "step": step, **info})

    def drain_log(self) -> list[dict[str, Any]]:
        out, self.log = self.log, []
        return out

    def check(self, setting: ChaosSetting) -> None:
        """Raise `ChaosConfigError` (located) if a fault of this rank cannot fire in `setting`."""
        check_setting(self.faults, setting)

    def _first_due(self, kind: str, step: int) -> int | None:
        """The index of the first unfired fault of `kind` whose step has come, or None.

        For faults that fire once per run at the first boundary or write at or
        after their step where they can act (a checkpoint to corrupt or to fail).
        """
        for i, f in enumerate(self.faults):
            if f.kind == kind and f.at_step <= step and self.record.get(self._keys[i]) is None:
                return i
        return None

    def at_boundary(self, step: int, checkpoints: Any) -> None:
        """Boundary faults: flip bytes in the newest durable checkpoint (`CheckpointStore`),
        at the first boundary at or after the fault's step where one is on disk."""
        if checkpoints is None or not self.faults:
            return
        i = self._first_due("corrupt_checkpoint", step)
        if i is None:
            return
        checkpoints.wait()  # the newest one may still be on its way to disk
        steps = checkpoints.steps()
        if not steps:
            return  # nothing on disk yet (all retired by a rollback): the next boundary
        newest = steps[-1]
        self.record.mark(
            self._keys[i],
            {"kind": "corrupt_checkpoint", "rank": self.rank, "step": step,
             "checkpoint_step": newest},
        )  # fmt: skip
        corrupt_file(checkpoints.directory / f"step-{newest:08d}.rank{self.rank}.pt")
        self._note("corrupt_checkpoint", step, checkpoint_step=newest)

    def checkpoint_write_fault(self, step: int) -> Fault | None:
        """A `checkpoint_write_error` due for the durable checkpoint written at `step` (marked
        fired on its last failing write), or None: the Guard writes it under `failing_writes`."""
        for i, f in enumerate(self.faults):
            if f.kind != "checkpoint_write_error" or f.at_step > step:
                continue
            fired = self.record.get(self._keys[i]) or {}
            done = int(fired.get("writes", 0)) if isinstance(fired.get("writes"), int) else 0
            if fired and done >= f.duration:
                continue
            self.record.mark(
                self._keys[i],
                {"kind": f.kind, "rank": self.rank, "step": fired.get("step", step),
                 "writes": done + 1},
            )  # fmt: skip
            self._note("checkpoint_write_error", step, write=done + 1)
            return f
        return None

    def before_batch(self, step: int) -> None:
        """Loader-side faults: slow batches."""
        for _, f in self._window("slow_loader", step):
            time.sleep(f.seconds)
            self._note("slow_loader", step, seconds=f.seconds)

    def before_step(self, step: int) -> None:
        """Process-level faults at the start of a step: leaks, OOM, a killed rank, a straggler."""
        for _, f in self._window("slow_rank", step):
            process_faults.slow(f.seconds)  # inside the step, before its collectives
            self._note("slow_rank", step, seconds=f.seconds)
        for _, f in self._window("memory_leak", step):
            self._leak.append(torch.empty(f.bytes, dtype=torch.uint8).fill_(1))
            self._note("memory_leak", step, bytes=f.bytes)
        if self.fire_once("oom", step) is not None:
            self._note("oom", step)
            raise torch.OutOfMemoryError(f"chaos: injected out-of-memory at step {step}")
        if self.fire_once("kill_rank", step) is not None:
            process_faults.kill()
        if self.fire_once("hang_rank", step) is not None:
            process_faults.hang()
        if self._kill_supervisor is not None and self.fire_once("kill_supervisor", step):
            self._note("kill_supervisor", step)
            self._kill_supervisor()
        if self._kill_node is not None and self.fire_once("kill_node", step):
            why = self._kill_node()  # returns only when the node is not killed
            self._note("kill_node", step, refused=why)

    def on_join(self) -> None:
        """A replacement of this rank formed its generation and is about to adopt the state:
        killed if a `kill_rank` of this rank fired and has kills left (`duration` n: n-1)."""
        for i, f in enumerate(self.faults):
            if f.kind != "kill_rank" or f.duration < 2:
                continue
            fired = self.record.get(self._keys[i])
            if not fired:
                continue  # the first kill is at its step
            kills = fired.get("kills", 1)
            kills = kills if type(kills) is int else f.duration
            if kills >= f.duration:
                continue
            self.record.mark(self._keys[i], {**fired, "kills": kills + 1})
            process_faults.kill()

    def on_loss(self, step: int, batch_index: int, loss: torch.Tensor) -> torch.Tensor:
        """Loss-side faults: NaN and poisoned (spiking) batches."""
        if self._fire_repeated("nan_loss", step) is not None:
            self._note("nan_loss", step)
            return loss * float("nan")
        for i, f in self._window("loss_spike", step):
            if self.record.get(self._keys[i]) is None:
                # The fault names its batches when it first fires; from then on
                # they are bad data, whatever step trains on them.
                fired = {
                    "kind": "loss_spike",
                    "rank": self.rank,
                    "step": step,
                    "batches": [batch_index, batch_index + f.duration],
                    "factor": f.factor or 10.0,
                }
                self.record.mark(self._keys[i], fired)
                self._poison(fired)
        factor = (
            self._factor(batch_index) if self._factor_override is None else self._factor_override[0]
        )
        if factor is not None:
            self._note("loss_spike", step, batch_index=batch_index, factor=factor)
            loss = loss * factor
        self._overflow(step, loss)
        boom = self.fire_once("grad_explosion", step)
        if boom is not None and loss.requires_grad:
            # Scaled where backward starts: the loss reads the same, this rank's gradients
            # explode, and a data-parallel all-reduce spreads them as it would a real one.
            grad_factor = boom.factor or 1e6
            loss.register_hook(lambda g: g * grad_factor)
            self._note("grad_explosion", step, factor=grad_factor)
        return loss

    def _overflow(self, step: int, loss: torch.Tensor) -> None:
        """A scaler_overflow_storm step: the gradient entering backward is set past float16's
        range, so the float16 backward overflows for real and the GradScaler finds infs."""
        storm = self.fire_once("scaler_overflow_storm", step, tick=self._tick)
        if storm is not None:
            self._storm = (self._tick + storm.duration, storm.factor or STORM_FACTOR)
        if self._storm is None or self._tick >= self._storm[0]:
            self._storm = None
            return
        if loss.requires_grad:
            factor = self._storm[1]
            loss.register_hook(lambda g: torch.full_like(g, factor))
            self.storm_steps += 1
            self._note("scaler_overflow_storm", step, factor=factor)

    def tick(self, tick: int) -> None:
        """The rank's executed-step count as a step begins (storms last so many executed steps)."""
        self._tick = tick

    def _poison(self, fired: Mapping[str, Any]) -> None:
        span, factor = fired.get("batches"), fired.get("factor", 10.0)
        if (
            isinstance(span, list)
            and len(span) == 2
            and all(type(b) is int for b in span)
            and isinstance(factor, int | float)
        ):
            self._poisoned.append((span[0], span[1], float(factor)))

    def _factor(self, batch_index: int) -> float | None:
        for first, end, factor in self._poisoned:
            if first <= batch_index < end:
                return factor
        return None

    def on_grads(self, step: int, params: list[torch.nn.Parameter]) -> None:
        """Gradient-side faults after backward: a NaN gradient; a late all-reduce."""
        f = self.fire_once("slow_collective", step)
        if f is not None:
            process_faults.slow(f.seconds)
            self._note("slow_collective", step, seconds=f.seconds)
        if self.fire_once("nan_grad", step) is not None:
            for p in params:
                if p.grad is not None:
                    local(p.grad).view(-1)[0] = float("nan")  # a sharded model: this rank's shard
                    break
            self._note("nan_grad", step)
        for i, f, _ in self._corrupting("grad", step):
            name, param = self._aims[i]
            assert param is not None
            if param.grad is not None:
                done = bitflips.flip_bit(param.grad, f.index, f.bit)
                self._note(f.kind, step, target="grad", name=name, **done)

    @property
    def poisoned_batches(self) -> list[int]:
        """Every batch index a loss_spike poisoned, in order."""
        return sorted({b for first, end, _ in self._poisoned for b in range(first, end)})
