"""``python -m memsim ...``: the command line."""

import sys

from memsim.entry import main

sys.exit(main())
