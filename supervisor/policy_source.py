"""Policies from untrusted bytes: a file saved over a running job's policy, or `policy apply`.

Whatever the bytes (binary, not UTF-8, nested past the parser's recursion
limit, huge), loading either returns a validated `Policy` or raises
`PolicyError` with located lines; it never raises anything else, so the
supervisor that watches a policy file cannot be killed by what is saved in it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from remedy import policies
from remedy.policies import Diagnostic, Policy, PolicyError, load_policy_text
from remedy.policies._loader import resolve_policy_source

# More than any real policy (the bundled ones are a few kB); the policy
# loader applies its own bounds on top of this one.
MAX_POLICY_BYTES = 1 << 20


def read_policy_bytes(source: str) -> tuple[bytes, str]:
    """The bytes of a policy file or bundled policy and the name to report; PolicyError if unreadable."""
    path = resolve_policy_source(source)
    try:
        # A FIFO or a device would block or never end: only regular files are read.
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise PolicyError([Diagnostic(str(path), 1, 1, "policy file is not a regular file")])
        with open(path, "rb") as fh:
            data = fh.read(MAX_POLICY_BYTES + 1)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise PolicyError(
            [Diagnostic(str(path), 1, 1, f"cannot read policy file: {reason}")]
        ) from None
    return data, str(path)


def policy_from_bytes(data: bytes | str, filename: str) -> Policy:
    """Validate policy bytes (or text); PolicyError for anything wrong, never another exception."""
    if isinstance(data, str):
        data = data.encode("utf-8", errors="surrogateescape")
    if len(data) > MAX_POLICY_BYTES:
        raise PolicyError(
            [Diagnostic(filename, 1, 1, f"policy file is larger than {MAX_POLICY_BYTES} bytes")]
        )
    loader = getattr(policies, "load_policy_bytes", None)
    try:
        if loader is not None:
            policy: Policy = loader(data, filename)
            return policy
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PolicyError(
                [Diagnostic(filename, *_line_col(data, exc.start), "policy file is not UTF-8 text")]
            ) from None
        if "\x00" in text:
            raise PolicyError(
                [
                    Diagnostic(
                        filename, *_line_col(data, data.index(b"\x00")), "policy file is binary"
                    )
                ]
            )
        return load_policy_text(text, filename)
    except PolicyError:
        raise
    except (RecursionError, MemoryError) as exc:
        raise PolicyError(
            [
                Diagnostic(
                    filename,
                    1,
                    1,
                    f"policy file is too deeply nested or too large ({type(exc).__name__})",
                )
            ]
        ) from None
    # Untrusted input: any failure is a refusal, never a crash of the caller.
    except Exception as exc:
        raise PolicyError(
            [
                Diagnostic(
                    filename, 1, 1, f"policy file cannot be loaded: {type(exc).__name__}: {exc}"
                )
            ]
        ) from None


def load_policy_source(source: str) -> Policy:
    """A policy file or bundled name, loaded as untrusted bytes."""
    data, name = read_policy_bytes(source)
    return policy_from_bytes(data, name)


def _line_col(data: bytes, offset: int) -> tuple[int, int]:
    head = data[:offset]
    line = head.count(b"\n") + 1
    return line, offset - (head.rfind(b"\n") + 1) + 1


def is_policy_file(source: str) -> bool:
    """Whether `source` names a file (watched for hot reload) rather than a bundled policy."""
    try:
        return Path(source).is_file()
    except OSError:
        return False
