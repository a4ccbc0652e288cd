"""Where `notify` decisions go: the policy's `notify:` sinks, validated and compiled.

A policy may list sinks at its top level; each is one mapping with one key:

    notify:
      - webhook: {url_env: SLACK_WEBHOOK_URL, format: slack}
      - alertmanager: {url: "http://alertmanager:9093"}
      - command: {argv: [/usr/local/bin/page-oncall, --team, ml]}

A URL that is a secret (Slack's webhook URLs are) is named by the environment
variable that holds it (`url_env`) instead of written into the file. Only the
shape is checked here; delivery belongs to the supervisor (`supervisor.notify`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import PlainValidator
from pydantic_core import PydanticCustomError

from remedy.policies._types import name_validator, number_validator

SINK_KINDS: tuple[str, ...] = ("webhook", "alertmanager", "command")
WEBHOOK_FORMATS: tuple[str, ...] = ("generic", "slack")
# Defaults: each try waits at most this long for the sink, and a delivery is tried this often.
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_ATTEMPTS = 3
MAX_ATTEMPTS = 10


def _url(value: Any) -> str:
    if isinstance(value, str) and value.startswith(("http://", "https://")) and len(value) > 8:
        return value
    raise PydanticCustomError("url", f"expected an http:// or https:// URL, got {value!r}")


def _env_name(value: Any) -> str:
    if (
        isinstance(value, str)
        and value
        and (value[0].isalpha() or value[0] == "_")
        and all(c.isalnum() or c == "_" for c in value)
    ):
        return value
    raise PydanticCustomError(
        "env_name", f"expected an environment variable name (like SLACK_WEBHOOK_URL), got {value!r}"
    )


def _argv(value: Any) -> list[str]:
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value) and value[0]:
        return list(value)
    raise PydanticCustomError(
        "argv",
        f"expected a non-empty list of strings (the program, then its arguments), got {value!r}",
    )


def _labels(value: Any) -> dict[str, str]:
    if isinstance(value, dict) and all(
        isinstance(k, str) and k and isinstance(v, str) for k, v in value.items()
    ):
        return dict(value)
    raise PydanticCustomError(
        "labels", f"expected a mapping of label names to strings, got {value!r}"
    )


Url = Annotated[str, PlainValidator(_url)]
EnvName = Annotated[str, PlainValidator(_env_name)]
Timeout = Annotated[float, PlainValidator(number_validator(lo=0, hi=60, lo_open=True))]
Attempts = Annotated[int, PlainValidator(number_validator(lo=1, hi=MAX_ATTEMPTS, integer=True))]
WebhookFormat = Annotated[str, PlainValidator(name_validator(WEBHOOK_FORMATS, "webhook format"))]
Argv = Annotated[list[str], PlainValidator(_argv)]
Labels = Annotated[dict[str, str], PlainValidator(_labels)]


@dataclass(frozen=True, slots=True)
class NotifySink:
    """One compiled sink. `url_env` names the variable that holds the URL, if `url` is not given."""

    kind: Literal["webhook", "alertmanager", "command"]
    url: str | None = None
    url_env: str | None = None
    format: str = "generic"
    argv: tuple[str, ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    timeout_s: float = DEFAULT_TIMEOUT_S
    attempts: int = DEFAULT_ATTEMPTS
    line: int = 0

    def describe(self) -> str:
        """A short name for journals and messages (never the URL: it may be a secret)."""
        if self.kind == "command":
            return f"command {self.argv[0]}"
        where = f"${self.url_env}" if self.url_env else "url"
        if self.kind == "webhook":
            return f"webhook ({self.format}, {where})"
        return f"alertmanager ({where})"
