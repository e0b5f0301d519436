"""Packs: everything a model's sparse modes need, prepared once and verified on every use.

``prepare(model, out, **settings) -> Pack`` runs the stages (calibration, profile, thresholds,
predictors, placement) into one versioned directory, reusing the stages whose inputs did not
change; ``Pack.load(dir, model)`` reads and verifies one; ``jpinfer.load(model, pack=dir, mode=...)``
takes what the mode needs from it; ``default_pack()`` is the default model's, built into the cache
on first use. Modules: settings (what each stage reads, stage keys), store (the directory and its
verification), stages (the stages and prepare), engine (a pack as ``jpinfer.load``'s arguments), cli
(``jpinfer prepare``).
"""

from jpinfer.pack.engine import default_pack, mode_arguments, pack_for
from jpinfer.pack.stages import default_pack_dir, prepare
from jpinfer.pack.settings import STAGES, PackSettings
from jpinfer.pack.store import Pack, PackError, PackIncompleteError, PackMismatchError

__all__ = ["prepare", "default_pack", "default_pack_dir", "pack_for", "mode_arguments", "Pack", "PackSettings", "PackError",
           "PackIncompleteError", "PackMismatchError", "STAGES"]
