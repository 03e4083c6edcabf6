"""gem-train: recipes, the trainer (torchrec DMP, AdamW + fused sparse optimizer), NE/AUC, DCP checkpoints, CLI.

Names are imported lazily: the configs and recipes need no torch, so ``gem-train --help``,
``--print-config`` and misuse errors answer at once; the trainer, checkpoints and parallelism
bring in torch and torchrec on first use.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
