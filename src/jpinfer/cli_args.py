"""Command-line arguments shared by several subcommands (kept here, below every stage, so
that a stage's subcommand does not import the top-level CLI)."""

from __future__ import annotations

import argparse

DTYPE_CHOICES = ("float32", "bfloat16", "float16")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """--model and --dtype, for every command that loads a model."""
    p.add_argument("--model", default=None, help="HF checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument(
        "--dtype", default="float32", choices=DTYPE_CHOICES,
        help="weight dtype (default float32; on the CPU bfloat16 decodes 5-8x slower, see README)",
    )
