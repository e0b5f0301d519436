"""``python -m jpinfer ...`` is the ``jpinfer`` command (see jpinfer.cli)."""

import sys

from jpinfer.cli import main

sys.exit(main())
