"""``python -m dataferry.server``: the same as ``dataferry serve``."""

import sys

from ._cli import main

sys.exit(main())
