"""Packs: everything a model's sparse modes need, prepared once and verified on every use.

``prepare(model, out, **settings) -> Pack`` runs the stages (calibration, profile, thresholds,
predictors, placement) into one versioned directory, reusing the stages whose inputs did not
change; ``Pack.load(dir, model)`` reads and verifies one; ``jpinfer.load(model, pack=dir, mode=...)``
takes what the mode needs from it (``modes.Mode.from_pack``); ``default_pack()`` is the default
model's, built into the cache on first use. Modules: settings (what each stage reads, stage keys),
store (the directory and its verification), stages (the stages and prepare), default (the default
pack), cli (``jpinfer prepare``).
"""

from jpinfer.pack.default import default_pack, pack_for
from jpinfer.pack.settings import STAGES, PackSettings
from jpinfer.pack.stages import default_pack_dir, prepare
from jpinfer.pack.store import Pack, PackError, PackIncompleteError, PackMismatchError

__all__ = ["prepare", "default_pack", "default_pack_dir", "pack_for", "Pack", "PackSettings", "PackError",
           "PackIncompleteError", "PackMismatchError", "STAGES"]
