# The names this package exports, read by lazy_loader.attach_stub at import time (each
# loads its module on first use) and by type checkers.

from .checkpoint import CheckpointError as CheckpointError
from .checkpoint import CheckpointMismatchError as CheckpointMismatchError
from .checkpoint import CheckpointSaveError as CheckpointSaveError
from .checkpoint import IncompleteCheckpointError as IncompleteCheckpointError
from .checkpoint import latest_checkpoint as latest_checkpoint
from .checkpoint import load_checkpoint as load_checkpoint
from .checkpoint import save_checkpoint as save_checkpoint
from .config import DataConfig as DataConfig
from .config import OptimConfig as OptimConfig
from .config import ParallelConfig as ParallelConfig
from .config import PrecisionConfig as PrecisionConfig
from .config import TrainConfig as TrainConfig
from .config import apply_overrides as apply_overrides
from .metrics import auc as auc
from .metrics import normalized_entropy as normalized_entropy
from .parallel import DenseParallel as DenseParallel
from .parallel import ExpertParallelDHENLayer as ExpertParallelDHENLayer
from .recipes import RECIPES as RECIPES
from .recipes import get_recipe as get_recipe
from .recipes import h200 as h200
from .recipes import h200_large as h200_large
from .recipes import h200x8 as h200x8
from .recipes import tiny as tiny
from .trainer import Trainer as Trainer
from .trainer import init_distributed as init_distributed
from .trainer import resolve_device as resolve_device
