"""Ray Train's `train_loop_per_worker` run by remedy's supervisor instead of a `TorchTrainer`.

Inside a `TorchTrainer` the Guards decide once for the group (rank 0), and
Ray Train's `FailureConfig` starts a failed group again, whole. Where a run
should get what only remedy's supervisor does (a lost or hung rank replaced
alone from a warm spare while the others keep their state, the hang watch,
node agents), `run_supervised` runs the same loop function as a `remedy run`
does its target:

    from remedy.cli.ray_train import run_supervised

    summary = run_supervised(train_loop, train_loop_config={"lr": 0.1},
                             num_workers=2, run_dir="/shared/runs/mine")

It takes `TorchTrainer`'s names for the loop, its config and the scaling, so a
`TorchTrainer(...).fit()` becomes a `run_supervised(...)` call. The loop and its
config are pickled into the run directory (`LOOP_FILE`), which every rank reads.
The loop finds its rank with `remedy.get_context()`; remedy forms the process group
(gloo, or NCCL with GPUs), and `ray.train.report` and `ray.train.get_context` are
not there (no Ray Train controller runs).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from remedy.protocol.exceptions import UsageError

# The target every rank runs: it loads the loop and its config from the run directory.
ENTRY = "remedy.cli.ray_train:run_loop"
# The pickled (loop, config) in the run directory.
LOOP_FILE = "ray-train-loop.pkl"


def run_supervised(
    train_loop_per_worker: Callable[..., Any],
    *,
    train_loop_config: dict[str, Any] | None = None,
    num_workers: int | None = None,
    scaling_config: Any = None,
    run_dir: str | os.PathLike[str] | None = None,
    policy: str = "default",
    spares: int | None = None,
    hang_watch: dict[str, float] | None = None,
    chaos: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Run `train_loop_per_worker(train_loop_config)` on `num_workers` ranks under remedy's
    supervisor; block until the run ends and return its summary (`summary.json`).

    `scaling_config` (a `ray.train.ScalingConfig`) may give `num_workers` and `use_gpu`
    instead; `policy`, `spares`, `hang_watch` and `chaos` (a chaos file) are `remedy run`'s.
    Joins the connected Ray, or starts a private one for the run as `remedy run` does.
    Raises `UsageError` (one line) for arguments that cannot run.
    """
    from remedy.protocol.spec import RunSpec  # noqa: PLC0415 - the ranks import this module too
    from remedy.rank.chaos.faults import ChaosSetting, load_chaos  # noqa: PLC0415
    from remedy.rundir.claim import claim_run_dir  # noqa: PLC0415
    from remedy.supervisor.policy_source import load_policy_source  # noqa: PLC0415

    workers, gpus = _scaling(num_workers, scaling_config)
    if not callable(train_loop_per_worker):
        raise UsageError(f"train_loop_per_worker must be a function, not {train_loop_per_worker!r}")
    load_policy_source(policy)  # a policy that does not load is refused before Ray starts
    spec = RunSpec(
        target=ENTRY,
        policy=str(Path(policy).resolve()) if Path(policy).is_file() else policy,
        workers=workers,
        gpus_per_rank=gpus,
        spares=spares,
        hang_watch=dict(hang_watch or {}),
        run_dir=os.fspath(run_dir) if run_dir is not None else "",
    )
    if chaos is not None:
        setting = ChaosSetting(world_size=workers, supervised=True)
        spec.faults = [f.model_dump() for f in load_chaos(os.fspath(chaos), setting=setting)]
    pickled = _pickled(train_loop_per_worker, train_loop_config)
    # The directory is claimed as `remedy run` claims it: a second run into it is refused,
    # and a run that never started leaves nothing behind.
    claim = claim_run_dir(
        Path(spec.run_dir),
        given=f"run_dir {run_dir}" if run_dir is not None else f"run directory {spec.run_dir}",
        run_id=spec.run_id,
    )
    try:
        loop = Path(spec.run_dir) / LOOP_FILE
        try:
            loop.write_bytes(pickled)
        except OSError as exc:
            raise UsageError(f"cannot write {loop}: {exc.strerror}") from None
        spec.argv = [str(loop)]
        return _supervise(spec, claim)
    finally:
        claim.release()  # a no-op once the run has started: its directory is its record


def _pickled(fn: Callable[..., Any], config: dict[str, Any] | None) -> bytes:
    """The loop and its config as the ranks load them. The loop's module travels by value when
    it is the user's own (a script, a test folder), as Ray Train's would from `__main__`: the
    ranks need not be able to import it; an installed package's is imported there."""
    from ray import cloudpickle  # noqa: PLC0415 - the rank side imports this module too

    from remedy.rank.loop.target import is_user_file  # noqa: PLC0415

    module = inspect.getmodule(fn)
    source = getattr(module, "__file__", None)
    by_value = module is not None and module.__name__ != "__main__" and bool(source)
    by_value = by_value and is_user_file(str(source))
    if by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return bytes(cloudpickle.dumps((fn, config)))
    except Exception as exc:  # any pickling failure: say what cannot travel to the ranks
        raise UsageError(
            "train_loop_per_worker or train_loop_config cannot be pickled for the ranks: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)


def _scaling(num_workers: int | None, scaling_config: Any) -> tuple[int, float]:
    """The number of ranks and GPUs per rank, from `num_workers` or a ScalingConfig."""
    gpus = 0.0
    if scaling_config is not None:
        given = getattr(scaling_config, "num_workers", None)
        if num_workers is not None and given is not None and given != num_workers:
            raise UsageError(
                f"num_workers={num_workers} and scaling_config.num_workers={given} differ"
            )
        num_workers = num_workers if given is None else int(given)
        gpus = 1.0 if getattr(scaling_config, "use_gpu", False) else 0.0
    workers = 1 if num_workers is None else num_workers
    if not isinstance(workers, int) or workers < 1:
        raise UsageError(f"num_workers must be a whole number of at least 1, not {workers!r}")
    return workers, gpus


def _supervise(spec: Any, claim: Any) -> dict[str, Any]:
    """Connect to Ray (or start a private one) and run `spec` under a supervisor, recorded in
    this machine's registry as `remedy run` records its runs (`remedy status`, `logs`, `stop`
    and `explain` find it by its id)."""
    from remedy.cli import registry  # noqa: PLC0415
    from remedy.cli.cluster import choose, connect, disconnect  # noqa: PLC0415
    from remedy.cli.runner import run_supervised as run_spec  # noqa: PLC0415

    conn = connect(choose(None), workers=spec.workers, quiet=True)
    try:
        registry.register_run(spec, conn, detached=False)
        claim.started = True
        summary = run_spec(spec)
        registry.update(spec.run_id, state=summary.get("status"))
        return summary
    finally:
        disconnect(conn)  # a Ray this process had joined before stays joined


def run_loop(argv: list[str]) -> Any:
    """The rank's target: call the pickled loop with its config (`run_supervised`)."""
    from ray import cloudpickle  # noqa: PLC0415

    (path,) = argv
    fn, config = cloudpickle.loads(Path(path).read_bytes())
    return fn(config) if inspect.signature(fn).parameters else fn()
