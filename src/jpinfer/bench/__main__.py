"""``python -m jpinfer.bench`` is ``jpinfer bench`` (engines side by side, see jpinfer.bench.compare);
``python -m jpinfer.bench --kernels ...`` is ``jpinfer bench-kernels ...`` (the sparse FFN kernels);
``python -m jpinfer.bench gpu ...`` is ``jpinfer bench-gpu ...`` (the GPU suite, jpinfer.bench.gpu_suite)."""

import sys

from jpinfer.cli import main

args = sys.argv[1:]
if args[:1] == ["gpu"]:
    sys.exit(main(["bench-gpu", *args[1:]]))
sys.exit(main(["bench-kernels", *[a for a in args if a != "--kernels"]] if "--kernels" in args else ["bench", *args]))
