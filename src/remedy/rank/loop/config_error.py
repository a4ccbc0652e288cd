"""A remedy configuration error raised from the user's call, said in one line.

A `Guard(..., state={"x": object()})` in a training function raises
`GuardConfigError` at construction. That is the user's input being wrong,
not a crash of theirs or of remedy's: the rank says it as a compiler would,
`FILE:LINE: error: message` at the user's own line, and keeps the traceback
for its log (`supervisor.rank`), where a person debugging remedy looks.
"""

from __future__ import annotations

import traceback

from remedy.protocol.exceptions import RemedyError
from remedy.rank.loop.target import is_user_file


def config_error_line(exc: BaseException) -> str | None:
    """`FILE:LINE: error: message` for a remedy error raised from the user's code, else None.

    The location is the innermost frame of the user's code. A remedy error that no user
    line called (a target that cannot be imported, say) is not the user's input: None.
    """
    if not isinstance(exc, RemedyError):
        return None
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if is_user_file(f.filename)]
    if not frames:
        return None
    message = " ".join(str(exc).split()) or type(exc).__name__
    return f"{frames[-1].filename}:{frames[-1].lineno}: error: {message}"
