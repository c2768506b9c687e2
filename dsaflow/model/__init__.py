"""The DSA transformer: MLA in MQA mode + lightning indexer, F/S layer roles from the plan, serving caches."""
from .block import DSABlock, SwiGLU
from .cache import IndexCacheError, IndexSlot, StageCache
from .indexer import Indexer
from .indexer_loss import attention_distribution, indexer_kl_loss
from .mla import MLA
from .norms import RMSNorm
from .stage import StageModule, build_stages, full_state_dict, load_full_state_dict

__all__ = [
    "DSABlock",
    "IndexCacheError",
    "IndexSlot",
    "Indexer",
    "MLA",
    "RMSNorm",
    "StageCache",
    "StageModule",
    "SwiGLU",
    "attention_distribution",
    "build_stages",
    "full_state_dict",
    "indexer_kl_loss",
    "load_full_state_dict",
]
