"""gem-data: GEM-like data on Parquet (synthetic or converted logs) and balanced jagged batches.

Names are imported lazily: generating, converting or describing a dataset and the balance
tools need only numpy and pyarrow, while ``Batch``, the loaders and ``DevicePrefetcher`` bring
in torch and torchrec on first use.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
