"""The DSA transformer: MLA in MQA mode + lightning indexer, F/S layer roles (LayerSpec), serving caches. It knows
nothing of plans, Hydra or torch.distributed: dsaflow.pipeline.stages cuts it into a plan's stages."""

from .aux_loss import attach_aux_loss
from .block import DSABlock
from .cache import IndexCacheError, IndexSlot, StageCache
from .indexer import Indexer
from .indexer_loss import IndexerLossInBackward, attention_distribution, indexer_kl_loss
from .layer_spec import LayerSpec
from .mla import MLA
from .moe import MoE, Router, expert_load_balance, moe_layers, update_expert_bias
from .norms import RMSNorm
from .stage import StageModule, build_model, full_state_dict, load_full_state_dict, trim_indices
from .swiglu import SwiGLU

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
    "MoE",
    "Router",
    "attach_aux_loss",
    "attention_distribution",
    "expert_load_balance",
    "moe_layers",
    "update_expert_bias",
    "build_model",
    "full_state_dict",
    "indexer_kl_loss",
    "load_full_state_dict",
    "trim_indices",
]
