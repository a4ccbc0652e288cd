"""The policy's `notify:` sinks: validated like every other key, with FILE:LINE:COL errors."""

from __future__ import annotations

import pytest

from remedy.policies import NotifySink, PolicyError, load_policy_text

BASE = """\
version: 1
rules:
  - name: r
    when: {anomaly: loss_spike}
    do: [notify]
notify:
"""


def test_each_kind_of_sink_compiles_with_its_defaults() -> None:
    """webhook, alertmanager and command entries compile in order, defaults filled in."""
    policy = load_policy_text(
        BASE
        + "  - webhook: {url_env: SLACK_URL, format: slack}\n"
        + "  - alertmanager: {url: 'http://127.0.0.1:9093', labels: {team: ml}, attempts: 5}\n"
        + "  - command: {argv: [page, --team, ml], timeout_s: 2}\n",
        "p.yaml",
    )
    assert policy.notify == (
        NotifySink("webhook", url_env="SLACK_URL", format="slack", line=7),
        NotifySink("alertmanager", url="http://127.0.0.1:9093", labels=(("team", "ml"),),
                   attempts=5, line=8),
        NotifySink("command", argv=("page", "--team", "ml"), timeout_s=2.0, line=9),
    )  # fmt: skip
    assert [s.describe() for s in policy.notify] == [
        "webhook (slack, $SLACK_URL)",
        "alertmanager (url)",
        "command page",
    ]


def test_a_policy_without_sinks_has_none() -> None:
    """No `notify:` key: no sinks (notify decisions are logged and journaled only)."""
    assert load_policy_text(BASE.removesuffix("notify:\n"), "p.yaml").notify == ()


@pytest.mark.parametrize(
    ("entry", "where", "message"),
    [
        ("  - webhook: {url: 'ftp://x'}\n", "7:20", "url: expected an http:// or https:// URL"),
        ("  - webhook: {}\n", "7:14", "webhook needs `url` or `url_env`"),
        ("  - webhook: {url: 'http://a.b', url_env: X}\n", "7:14", "exactly one of them"),
        ("  - {}\n", "7:5", "needs exactly one of webhook, alertmanager, command (none)"),
        ("  - webhook: {url: 'http://a.b'}\n    command: {argv: [x]}\n", "7:5",
         "(2: webhook, command)"),
        ("  - webhok: {url: 'http://a.b'}\n", "7:5", "unknown sink 'webhok' in a notify entry"),
        ("  - webhook: {url: 'http://a.b', format: teams}\n", "7:42",
         "unknown webhook format 'teams' (valid: generic, slack)"),
        ("  - webhook: {url: 'http://a.b', token: x}\n", "7:34", "unknown key 'token' in a webhook"),
        ("  - command: {argv: []}\n", "7:21", "argv: expected a non-empty list of strings"),
        ("  - alertmanager: {url: 'http://a.b', attempts: 0}\n", "7:49",
         "attempts: out of range: expected an integer with 1 <= x <= 10"),
        ("  - alertmanager: {url: 'http://a.b', timeout_s: 600}\n", "7:50", "timeout_s: out of range"),
        ("  - webhook: {url_env: 'a-b'}\n", "7:24", "expected an environment variable name"),
        ("  - alertmanager: {url: 'http://a.b', labels: {team: 3}}\n", "7:47",
         "labels: expected a mapping of label names to strings"),
    ],
)  # fmt: skip
def test_bad_sinks_are_located(entry: str, where: str, message: str) -> None:
    """Every mistake in a sink is one error at its line and column, saying what to write."""
    with pytest.raises(PolicyError) as info:
        load_policy_text(BASE + entry, "p.yaml")
    first = str(info.value).splitlines()[0]
    assert first.startswith(f"p.yaml:{where}: error:"), first
    assert message in first


def test_notify_must_be_a_list() -> None:
    """`notify: 3` is refused at the value."""
    with pytest.raises(PolicyError, match=r"p.yaml:6:9: error: notify: expected a list"):
        load_policy_text(BASE.removesuffix("notify:\n") + "notify: 3\n", "p.yaml")
