import sys

from remedy.supervisor.cli import main

sys.exit(main())
