"""No wait is left without a bound: the supervisor side on other processes (`remedy.supervisor.waits`),
an actor call awaited as `await handle.method.remote(...)` included, the ranks on their helper
threads (`remedy.rank.loop.waits`); the ranks' collectives and rendezvous are bounded by the process
group's timeout, their reports by the reporter's."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from remedy.protocol.exceptions import WaitTimeout

SRC = Path(__file__).resolve().parents[2] / "src" / "remedy"
# Every package that waits on other processes or threads; the policy language is pure.
PACKAGES = [p for p in SRC.iterdir() if p.is_dir() and p.name not in ("policies", "__pycache__")]
BOUNDED = {"wait_for", "within", "get"}  # asyncio.wait_for, waits.within, waits.get
# remedy's own `wait` methods, each bounded inside (through `workers.waits`): the checkpoint
# store's and the shard mirror's.
OWN_BOUNDED_WAITS = {"self.wait", "checkpoints.wait", "mirror.wait", "guard.mirror.wait"}
# Markers on a line that says why its wait needs no bound of its own: the future is done
# already, the reference is ready, a worker thread idles for its next job until close sends
# it one, or the rendezvous, which the store and process group bound (`collective_timeout`);
# or an actor call awaited in a coroutine that its caller bounds (an `asyncio.wait` with a
# timeout that cancels what is left), or that lasts the run by design: the marker says which.
MARKERS = ("# ready", "# done", "# next job", "# rendezvous", "# caller bounds", "# whole run")


def _name(func: ast.expr) -> str:
    """`ray.get`, `asyncio.gather`, `self._done.wait`... as dotted text."""
    if isinstance(func, ast.Attribute):
        return f"{_name(func.value)}.{func.attr}"
    return func.id if isinstance(func, ast.Name) else "?"


def _awaited_call(
    node: ast.Await, inside_bound: set[int], lines: list[str], path: Path
) -> list[str]:
    """`await handle.method.remote(...)` not passed to a bounding call, nor marked: unbounded."""
    call = node.value
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
        return []
    if call.func.attr != "remote" or id(call) in inside_bound:
        return []
    if any(m in lines[node.lineno - 1] for m in MARKERS):
        return []
    return [f"{path.name}:{node.lineno}: await {_name(call.func)}"]


def unbounded(path: Path) -> list[str]:
    """The waits of one module that have no bound, as `file:line: call`."""
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    inside_bound: set[int] = set()  # ids of calls passed to a bounding call
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _name(node.func).rsplit(".", 1)[-1] in BOUNDED:
            for arg in node.args[:1]:
                for inner in ast.walk(arg):
                    inside_bound.add(id(inner))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Await):
            found.extend(_awaited_call(node, inside_bound, lines, path))
        if not isinstance(node, ast.Call):
            continue
        name = _name(node.func)
        last = name.rsplit(".", 1)[-1]
        kwargs = {k.arg: k.value for k in node.keywords}
        timed = "timeout" in kwargs or len(node.args) >= 3
        where = f"{path.name}:{node.lineno}: {name}"
        if any(m in lines[node.lineno - 1] for m in MARKERS):
            continue
        if name in ("ray.get", "ray.wait", "asyncio.wait"):
            if not timed:
                found.append(where)
        elif name == "asyncio.gather" or (
            last == "wait" and not node.args and "timeout" not in kwargs
        ):
            if id(node) not in inside_bound and name not in OWN_BOUNDED_WAITS:
                found.append(where)
        elif last in ("result", "join") and not node.args and "timeout" not in kwargs:
            found.append(where)  # a future's result, a thread's join
        elif last == "get" and name.endswith("queue.get") and not node.args and not kwargs:
            found.append(where)
        elif name.endswith("pool.shutdown"):
            wait = kwargs.get("wait")
            if not (isinstance(wait, ast.Constant) and wait.value is False):
                found.append(where)  # waits for every queued job, however long
    return found


@pytest.mark.timeout(30)
def test_every_wait_has_a_bound() -> None:
    """ray.get/ray.wait/asyncio.wait carry a timeout; gather and Event.wait sit inside a bounded
    wait; futures, threads, queues and pools are waited on with a timeout, in every package."""
    modules = sorted(p for package in PACKAGES for p in package.rglob("*.py"))
    assert len(modules) > 60
    left = [w for path in modules for w in unbounded(path)]
    assert left == [], "unbounded waits:\n" + "\n".join(left)


@pytest.mark.timeout(30)
def test_the_check_finds_an_unbounded_wait(tmp_path: Path) -> None:
    """A module with a bare ray.get, gather, Event.wait, future, join, queue, pool shutdown and an
    awaited actor call is caught once for each, and their bounded or marked forms are not."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import asyncio, ray\n"
        "async def f(ref, ev, aws):\n"
        "    ray.get(ref)\n"
        "    await asyncio.gather(*aws)\n"
        "    await ev.wait()\n"
        "    await asyncio.wait_for(ev.wait(), 1)\n"
        "    ray.get(ref, timeout=1)\n"
        "def g(fut, thread, work_queue, pool):\n"
        "    fut.result()\n"
        "    thread.join()\n"
        "    work_queue.get()\n"
        "    pool.shutdown()\n"
        "    fut.result(timeout=1); thread.join(1.0); work_queue.get(timeout=1)\n"
        "    pool.shutdown(wait=False); ', '.join(['a'])\n"
        "async def h(sup, waits):\n"
        "    await sup.report_many.remote(1,\n"
        "        2)\n"
        "    await waits.within(sup.report_many.remote(1), 5, 'report_many')\n"
        "    await asyncio.wait_for(sup.ping.remote(), 1)\n"
        "    await sup.result.remote()  # whole run: it answers when the rank ends\n"
    )
    assert sorted(w.split(": ")[1] for w in unbounded(bad)) == sorted([
        "ray.get", "asyncio.gather", "ev.wait", "fut.result", "thread.join", "work_queue.get",
        "pool.shutdown", "await sup.report_many.remote",
    ])  # fmt: skip


@pytest.mark.timeout(30)
def test_a_bounded_wait_names_itself() -> None:
    """waits.within past its bound raises WaitTimeout with the wait's name and bound."""
    import asyncio  # noqa: PLC0415

    from remedy.supervisor import waits  # noqa: PLC0415

    async def never() -> None:
        await asyncio.Event().wait()

    with pytest.raises(WaitTimeout, match=r"the spare's ping: no answer within 0.05s"):
        asyncio.run(waits.within(never(), 0.05, "the spare's ping"))


@pytest.mark.timeout(30)
def test_a_rank_wait_on_its_helper_thread_names_itself() -> None:
    """rank.loop.waits: a helper stuck past the bound is a WaitTimeout naming the wait; a pool
    whose queue is empty is drained without error and left shut down, and draining it again
    waits for nothing."""
    import threading  # noqa: PLC0415
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    from remedy.rank.exceptions import WaitTimeout as RankWaitTimeout  # noqa: PLC0415
    from remedy.rank.loop import waits as rank_waits  # noqa: PLC0415

    release = threading.Event()
    pool = ThreadPoolExecutor(1)
    stuck = pool.submit(release.wait, 10)
    with pytest.raises(RankWaitTimeout, match=r"the checkpoint writes: not done within 0.05s"):
        rank_waits.result(stuck, 0.05, "the checkpoint writes")
    with pytest.raises(RankWaitTimeout, match=r"the pool: not done within 0.05s"):
        rank_waits.drain(pool, 0.05, "the pool")
    release.set()
    assert stuck.result(timeout=5) is True
    idle = ThreadPoolExecutor(1)
    rank_waits.drain(idle, 5.0, "an idle pool")
    with pytest.raises(RuntimeError, match="shutdown"):
        idle.submit(lambda: None)
    rank_waits.drain(idle, 0.0, "an idle pool, again")  # shut down already: no wait, even at 0 s
