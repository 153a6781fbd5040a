"""``python -m dataferry.server``: the same as ``dataferry serve``."""

import sys

from .cli import main

sys.exit(main())
