"""No wait of the supervisor side on another process is left without a bound (`supervisor.waits`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from remedy.supervisor.exceptions import WaitTimeout

SUPERVISOR = Path(__file__).resolve().parents[2] / "supervisor"
BOUNDED = {"wait_for", "within", "get"}  # asyncio.wait_for, waits.within, waits.get


def _name(func: ast.expr) -> str:
    """`ray.get`, `asyncio.gather`, `self._done.wait`... as dotted text."""
    if isinstance(func, ast.Attribute):
        return f"{_name(func.value)}.{func.attr}"
    return func.id if isinstance(func, ast.Name) else "?"


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
        if not isinstance(node, ast.Call):
            continue
        name = _name(node.func)
        timed = any(k.arg == "timeout" for k in node.keywords) or len(node.args) >= 3
        where = f"{path.name}:{node.lineno}: {name}"
        if name in ("ray.get", "ray.wait", "asyncio.wait"):
            if not timed and "# ready" not in lines[node.lineno - 1]:
                found.append(where)
        elif (name == "asyncio.gather" or (name.endswith(".wait") and not node.args)) and id(
            node
        ) not in inside_bound:
            found.append(where)
    return found


@pytest.mark.timeout(30)
def test_every_wait_in_supervisor_has_a_bound() -> None:
    """ray.get/ray.wait/asyncio.wait carry a timeout; gather and Event.wait sit inside a bounded wait."""
    modules = sorted(SUPERVISOR.rglob("*.py"))
    assert len(modules) > 20
    left = [w for path in modules for w in unbounded(path)]
    assert left == [], "unbounded waits:\n" + "\n".join(left)


@pytest.mark.timeout(30)
def test_the_check_finds_an_unbounded_wait(tmp_path: Path) -> None:
    """A module with a bare ray.get, a bare gather and a bare Event.wait is caught three times."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import asyncio, ray\n"
        "async def f(ref, ev, aws):\n"
        "    ray.get(ref)\n"
        "    await asyncio.gather(*aws)\n"
        "    await ev.wait()\n"
        "    await asyncio.wait_for(ev.wait(), 1)\n"
        "    ray.get(ref, timeout=1)\n"
    )
    assert [w.split(": ")[1] for w in unbounded(bad)] == ["ray.get", "asyncio.gather", "ev.wait"]


@pytest.mark.timeout(30)
def test_a_bounded_wait_names_itself() -> None:
    """waits.within past its bound raises WaitTimeout with the wait's name and bound."""
    import asyncio  # noqa: PLC0415

    from remedy.supervisor import waits  # noqa: PLC0415

    async def never() -> None:
        await asyncio.Event().wait()

    with pytest.raises(WaitTimeout, match=r"the spare's ping: no answer within 0.05s"):
        asyncio.run(waits.within(never(), 0.05, "the spare's ping"))
