"""``python -m jpinfer.bench`` is ``jpinfer bench`` (engines side by side, see jpinfer.bench.compare)."""

import sys

from jpinfer.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
