"""The DSA transformer: MLA in MQA mode + lightning indexer, F/S layer roles (LayerSpec), serving caches. It knows
nothing of plans, Hydra or torch.distributed: dsaflow.run.stages cuts it into a plan's stages."""

from .block import DSABlock, SwiGLU
from .cache import IndexCacheError, IndexSlot, StageCache
from .indexer import Indexer
from .indexer_loss import IndexerLossInBackward, attention_distribution, indexer_kl_loss
from .layer_spec import LayerSpec
from .mla import MLA
from .norms import RMSNorm
from .stage import StageModule, build_model, full_state_dict, load_full_state_dict, trim_indices

__all__ = [
    "IndexerLossInBackward",
    "DSABlock",
    "IndexCacheError",
    "IndexSlot",
    "LayerSpec",
    "Indexer",
    "MLA",
    "RMSNorm",
    "StageCache",
    "StageModule",
    "SwiGLU",
    "attention_distribution",
    "build_model",
    "full_state_dict",
    "indexer_kl_loss",
    "load_full_state_dict",
    "trim_indices",
]
