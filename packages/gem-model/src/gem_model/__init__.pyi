# The names this package exports, read by lazy_loader.attach_stub at import time (each
# loads its module on first use) and by type checkers.

from .config import GemArchitecture as GemArchitecture
from .config import GemModelConfig as GemModelConfig
from .dhen import AttentionExpert as AttentionExpert
from .dhen import CrossExpert as CrossExpert
from .dhen import DHENLayer as DHENLayer
from .dhen import DotProductExpert as DotProductExpert
from .dhen import MLPExpert as MLPExpert
from .flops import ModelFlops as ModelFlops
from .flops import model_flops as model_flops
from .model import REGION_SCOPE_PREFIX as REGION_SCOPE_PREFIX
from .model import GemInputs as GemInputs
from .model import GemModel as GemModel
from .sequence import AttentionPrecision as AttentionPrecision
from .sequence import CandidateCrossAttention as CandidateCrossAttention
from .sequence import HistoryFeatureCrossAttention as HistoryFeatureCrossAttention
from .sequence import JaggedSelfAttentionLayer as JaggedSelfAttentionLayer
from .sequence import PoolingByMultiheadAttention as PoolingByMultiheadAttention
