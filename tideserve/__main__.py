"""``python -m tideserve``: the same command line as ``tideserve``."""

import sys

from tideserve.cli import main

sys.exit(main())
