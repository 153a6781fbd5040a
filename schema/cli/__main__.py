"""``python -m dataferry.schema.cli``: the ``dataferry`` command."""

import sys

from ._main import main

sys.exit(main())
