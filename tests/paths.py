"""Where this checkout's package is, for tests that start Python processes of their own."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# A subprocess imports this checkout's remedy (src/) and its tests and examples (the root),
# ahead of any other install of remedy.
PYTHONPATH = os.pathsep.join([str(REPO / "src"), str(REPO)])
