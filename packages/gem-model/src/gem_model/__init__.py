"""gem-model: the GEM recommendation model (torchrec embeddings, jagged sequence tower, DHEN, CTR/CVR heads).

Names are imported lazily: the architecture config (``GemArchitecture``, ``GemModelConfig``)
needs nothing but the standard library, so recipes and command lines can use it without
importing torch and torchrec; the modules bring them in on first use.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
