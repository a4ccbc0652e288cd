"""`python -m remedy`: the `remedy` command line."""

import sys

from remedy.cli.main import main

sys.exit(main())
