"""Running a native-kernel computation on one thread, for the tests that check results do not depend on
the thread count (csrc/common.h: fixed partitions, partial sums added in piece order)."""

from jpinfer.native import library


def on_one_thread(run):
    """run() with the native kernels capped at one thread; the cap is lifted again afterwards."""
    library.set_max_threads(1)
    try:
        return run()
    finally:
        library.set_max_threads(0)
