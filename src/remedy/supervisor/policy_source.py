"""Policies from untrusted bytes: a file saved over a running job's policy, or `policy apply`.

Whatever the bytes (binary, not UTF-8, nested past the parser's recursion
limit, huge), loading either returns a validated `Policy` or raises
`PolicyError` with located lines; it never raises anything else, so the
supervisor that watches a policy file cannot be killed by what is saved in it.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from remedy.policies import Diagnostic, Policy, PolicyError, load_policy_bytes
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
    """Validate policy bytes (or text); PolicyError for anything wrong, never another exception.

    The policy package bounds what a policy may be (size, encoding, control
    characters, nesting, aliases) with located errors; this only makes sure
    nothing else can escape to the supervisor that called it.
    """
    if isinstance(data, str):
        data = data.encode("utf-8", errors="surrogateescape")
    if len(data) > MAX_POLICY_BYTES:
        raise PolicyError(
            [Diagnostic(filename, 1, 1, f"policy file is larger than {MAX_POLICY_BYTES} bytes")]
        )
    try:
        return load_policy_bytes(data, filename)
    except PolicyError:
        raise
    # Untrusted input: any other failure is a refusal, never a crash of the caller.
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


def is_policy_file(source: str) -> bool:
    """Whether `source` names a file (watched for hot reload) rather than a bundled policy."""
    try:
        return Path(source).is_file()
    except OSError:
        return False


class PolicyWatch:
    """The saves of a watched policy file, each taken once.

    A change (the file's mtime, size or inode) is taken when it has stood
    still from one look to the next, so a writer part-way through its write is
    not read; and only when what it reads differs from what was last taken, so
    a save followed by a touch, or an editor that writes twice, is one save.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp = self._look()
        self._pending: tuple[int, int, int] | None = None
        self._taken: str | None = self._read()[0]  # the start's bytes: in force already

    def _look(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _read(self) -> tuple[str, tuple[bytes, str] | PolicyError]:
        """What the file holds now, keyed: its bytes' digest, or its refusal's text."""
        try:
            data, name = read_policy_bytes(str(self.path))
        except PolicyError as exc:
            return "error:" + "; ".join(d.format() for d in exc.diagnostics), exc
        return hashlib.sha256(data).hexdigest(), (data, name)

    def forget(self) -> None:
        """A policy came from elsewhere (`policy apply`): the file's next save is taken whatever it holds."""
        self._taken = None

    def poll(self) -> tuple[bytes, str] | None:
        """A new save's bytes and name, or None; PolicyError when the saved file cannot be read."""
        stamp = self._look()
        if stamp is None or stamp == self._stamp:
            self._pending = None
            return None
        if stamp != self._pending:  # changed since the last look: wait until it stands still
            self._pending = stamp
            return None
        self._stamp, self._pending = stamp, None
        key, saved = self._read()
        if key == self._taken:
            return None
        self._taken = key
        if isinstance(saved, PolicyError):
            raise saved
        return saved
