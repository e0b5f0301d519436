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


class ArtifactError(JpinferError):
    """A file jpinfer wrote earlier (a profile, predictor samples, a placement, predictors) that
    cannot be used: missing, damaged, incomplete, of another format version or made for another
    model. Such files are the user's results, so they are refused, never silently remade: the
    message names the file, what is wrong and how to make it again."""


class CacheError(JpinferError):
    """The cache directory ($JPINFER_CACHE) cannot be created or written; the message names it
    and says how to point jpinfer at a writable one."""
