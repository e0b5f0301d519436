"""Named model shapes and named placement runs: what ``jpinfer place`` and the placement benches
compare, kept with the solver so that a bench reads the same shapes as the command without importing it."""

from __future__ import annotations

from jpinfer.config import ModelConfig

SHAPES = {
    "llama2-7b": ModelConfig(
        vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, head_dim=128, d_ff=11008,
        name="llama2-7b-shape",
    ),
    "llama2-70b": ModelConfig(
        vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128, d_ff=28672,
        name="llama2-70b-shape",
    ),
}
RUNS = {  # name -> (method, objective)
    "mass": ("milp", "mass"),
    "latency": ("milp", "latency"),
    "greedy": ("greedy", "mass"),
    "layers": ("layers", "mass"),
}
