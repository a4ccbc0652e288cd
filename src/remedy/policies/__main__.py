"""`python -m remedy.policies check|test FILE...`."""

from __future__ import annotations

import sys

from remedy.policies.cli import main

if __name__ == "__main__":
    sys.exit(main())
