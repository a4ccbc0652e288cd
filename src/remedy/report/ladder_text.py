"""The escalation ladder in words, for `remedy explain`: the rungs each incident climbed.

Read from the journal only: every decision a rung issued carries
`anomaly.details.ladder` (`policies._ladder`); the policy's own first
remedy for the incident is the decision of the same rule, kind and step
without it.
"""

from __future__ import annotations

from typing import Any


def ladder_of(d: dict[str, Any]) -> dict[str, Any] | None:
    """The ladder record a decision's anomaly carries, or None."""
    details = (d.get("anomaly") or {}).get("details")
    found = details.get("ladder") if isinstance(details, dict) else None
    return found if isinstance(found, dict) else None


def decision_line(d: dict[str, Any]) -> str | None:
    """One line for a decision the ladder issued (None for any other decision)."""
    found = ladder_of(d)
    if found is None:
        return None
    how = "climbed to" if found.get("climbed") else "stayed on"
    return (
        f"escalation ladder: {found.get('incident')} came back after a rewind "
        f"({found.get('sightings')} sightings in all); {how} rung {found.get('rung')} of "
        f"{found.get('rungs')} ({found.get('name')})"
    )


def overview_lines(decisions: list[dict[str, Any]]) -> list[str]:
    """Per incident the ladder took over: each chain issued for it, rung by rung."""
    incidents: dict[str, list[dict[str, Any]]] = {}
    for d in decisions:
        found = ladder_of(d)
        if found is not None and isinstance(found.get("incident"), str):
            incidents.setdefault(found["incident"], []).append(d)
    if not incidents:
        return []
    out = ["escalation ladder (incidents that came back at the same step after a rewind):"]
    for name, mine in incidents.items():
        rule = mine[0].get("rule")
        anomaly = mine[0].get("anomaly") or {}
        first = [
            d
            for d in decisions
            if d.get("rule") == rule
            and ladder_of(d) is None
            and (d.get("anomaly") or {}).get("kind") == anomaly.get("kind")
            and (d.get("anomaly") or {}).get("step") == anomaly.get("step")
            and d.get("outcome") != "suppressed"
        ]
        rungs = []
        for d in _chain_heads(first) + _chain_heads(mine):
            found = ladder_of(d) or {"rung": 0, "name": "policy"}
            rungs.append(
                f"rung {found.get('rung')} {found.get('name')}: {d.get('action')} "
                f"[{d.get('outcome')}] ({d.get('decision_id')})"
            )
        out.append(f"  {name} (rule {rule!r}):")
        out.extend(f"    {text}" for text in rungs)
        last = ladder_of(mine[-1]) or {}
        if last.get("name") == "stop":
            out.append(f"    stopped: {(mine[-1].get('params') or {}).get('reason')}")
    return out


def _chain_heads(decisions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first decision of each chain (a rung's chain is one line)."""
    seen: set[Any] = set()
    out = []
    for d in decisions:
        chain = (d.get("chain") or {}).get("id") or d.get("decision_id")
        if chain not in seen:
            seen.add(chain)
            out.append(d)
    return out
