"""``python -m memsim ...``: the command line."""

import sys

from memsim.cli import main

sys.exit(main())
