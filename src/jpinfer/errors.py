"""The project's error family.

Every problem with what a user gives (arguments, checkpoints, profiles, placements,
corpora) raises a ``JpinferError``, a ``ValueError`` with a message that names the
file or argument and says what to change, so ``except jpinfer.JpinferError`` (or the
narrower ``except jpinfer.CheckpointError``) catches them without catching bugs.
"""

from __future__ import annotations


class JpinferError(ValueError):
    """Bad input to jpinfer; the message says what is wrong and what to change."""


class CheckpointError(JpinferError):
    """A checkpoint that cannot be loaded (HF directory, safetensors, GGUF, tokenizer fields,
    the default model's package); the message names the file and the problem."""
