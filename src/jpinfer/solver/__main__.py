"""``python -m jpinfer.solver`` is ``jpinfer place`` (neuron placement, see jpinfer.solver.cli)."""

import sys

from jpinfer.cli import main

sys.exit(main(["place", *sys.argv[1:]]))
