"""What the kernels need from the Pallas Triton lowering, in one place.

The Triton backend is deprecated since jax 0.11 (still working in 0.11.2, no removal version
announced): it is imported only when a kernel is compiled for a GPU or uses an atomic, so a jax
without it still imports jpinfer, and ``triton_available`` lets the op fall back to XLA.
"""

from __future__ import annotations

import jax


def is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def tile(d: int, cap: int) -> int:
    """Largest power of two dividing d, at most ``cap`` (Triton tiles are powers of two)."""
    return min(d & -d, cap)


def triton_available() -> bool:
    """Whether this jax has the Pallas Triton lowering with what the kernels use."""
    try:
        from jax.experimental.pallas import triton as pltriton
    except ImportError:
        return False
    return hasattr(pltriton, "CompilerParams") and hasattr(pltriton, "atomic_add")


def compiler_params(interpret: bool, num_warps: int = 4, num_stages: int = 2):
    """Triton compiler parameters for a GPU call; None in interpret mode."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def atomic_add(ref, idx, value: jax.Array) -> None:
    """``ref[idx] += value`` atomically (fp32 adds on the GPU; sequential in interpret mode)."""
    from jax.experimental.pallas import triton as pltriton

    pltriton.atomic_add(ref, idx, value)
