"""Typed config schema: one dataclass per Hydra group, registered in the ConfigStore.

Hydra merges the YAML files of `configs/` into these dataclasses, so an unknown key or a wrong type fails at compose
time with a message that names the key. Defaults here are the embedded default run (CPU-sized).

Ownership: each group's dataclass is the single place its fields are declared; the planner (`dsaflow.plan`) is the
single place cross-field rules are checked.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional


@dataclass
class ModelConfig:
    """DSA transformer shapes (DeepSeek-V3.2 naming). MLA in MQA mode: one latent row of
    `kv_lora_rank + qk_rope_head_dim` per token is shared by all heads."""

    name: str = "tiny"
    num_layers: int = 8
    dim: int = 64
    n_heads: int = 4
    q_lora_rank: int = 32
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    index_n_heads: int = 4
    index_head_dim: int = 16
    index_rope_head_dim: int = 8  # RoPE is applied to the first `index_rope_head_dim` dims of index q/k
    index_topk: int = 16
    inter_dim: int = 128  # SwiGLU hidden size (every layer is dense; MoE is out of scope)
    vocab_size: int = 256
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02


@dataclass
class IndexConfig:
    """Which layers are F (run the indexer) and which are S (reuse the nearest preceding F on the stage).

    Exactly one of: top-level `layout`, `pattern` (tiled over the layers), or `freq` (+ `offset`):
    layer i is F iff i < offset or (i - offset) % freq == 0. None of them set means every layer is F."""

    name: str = "all_full"
    pattern: Optional[str] = None
    freq: Optional[int] = None
    offset: int = 0


@dataclass
class PipelineConfig:
    """Stage boundaries and schedule. `boundaries` lists the first layer of each stage after the first (or each
    stage, starting at 0); otherwise `stages` stages are cut by `balance` (cost | layers)."""

    name: str = "single"
    stages: int = 1
    boundaries: Optional[List[int]] = None
    balance: str = "cost"
    ranks: Optional[int] = None  # pipeline ranks; None = stages (one stage per rank)
    schedule: str = "1F1B"  # GPipe | 1F1B | Interleaved1F1B | LoopedBFS | InterleavedZeroBubble | ZBVZeroBubble
    microbatches: int = 4
    cross_stage_indices: bool = False  # reserved: off by default, the plan reports its cost


@dataclass
class GraphBlockConfig:
    """A region to capture as a CUDA graph on every device that owns it, once per shape class.

    kind: decode | prefill | head | layers. `layers` = [first, last] (inclusive) for kind=layers."""

    name: str = "decode"
    kind: str = "decode"
    layers: Optional[List[int]] = None
    shape_classes: List[int] = field(default_factory=lambda: [1, 2, 4, 8])


@dataclass
class GraphsConfig:
    name: str = "off"
    enabled: bool = False
    blocks: List[GraphBlockConfig] = field(default_factory=list)
    max_shape: int = 256  # largest allowed shape class (batch for decode, tokens for prefill)
    cache: bool = True  # false = debug bypass: evict before lookup, capture afresh on every call
    on_failure: str = "error"  # error | eager


@dataclass
class TrainConfig:
    """Optimisation, the DSA recipe, eval, checkpoints. Defaults: the embedded main job (retrieval, 2-core CPU)."""

    name: str = "default"
    steps: int = 300
    seed: int = 0
    seq_len: int = 128
    batch_size: int = 16  # sequences per step (split into pipeline.microbatches)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0  # global norm over every stage (main and indexer params clipped separately); 0 = off
    dsa_stage: str = "sparse"  # dense_warmup | sparse
    dense_warmup_steps: int = 0  # steps of dense_warmup before `sparse` (when dsa_stage=sparse)
    indexer_lr: float = 1e-3
    indexer_loss_weight: float = 1.0
    dtype: str = "auto"  # auto (bf16 autocast on GPU, fp32 on CPU) | fp32 | bf16
    # Fixed reduction orders instead of atomics (sparse-attention backward, torch ops that have a deterministic
    # implementation): repeated runs give bit-identical results; slower (docs/training.md).
    deterministic: bool = False
    log_every: int = 10
    eval_every: int = 50  # 0 = only at the end
    eval_batches: int = 4
    ckpt_every: int = 0  # 0 = only at the end
    final_ckpt: bool = True  # save a checkpoint after the last step (benchmarks turn it off)
    resume: bool = False  # continue from the latest checkpoint in run_dir
    stop_at_step: Optional[int] = None  # pre-emption drill: exit after this step without the final checkpoint
    device: str = "auto"  # auto | cpu | cuda
    cpu_threads: int = 1  # torch threads per CPU rank: tiny models gain nothing from more, oversubscription costs 100x
    peak_tflops: Optional[float] = None  # per-rank peak for the MFU estimate; None = known GPU table / CPU nominal
    progress: str = "auto"  # auto (rich bar on a TTY, lines otherwise) | rich | lines | off


@dataclass
class DataConfig:
    name: str = "retrieval"
    kind: str = "retrieval"  # retrieval | text | bin
    path: Optional[str] = None  # text file/folder or nanoGPT-style .bin token file (uint16)
    num_pairs: int = 1  # retrieval: key-value pairs hidden in the filler (1 = needle in a haystack)
    num_queries: int = 1  # retrieval: queries at the end (keys drawn with replacement); accuracy is per query
    key_len: int = 1
    value_len: int = 1
    loss_on: str = "answer"  # retrieval: LM loss on the answer bytes only (answer) or on every byte (all)
    val_fraction: float = 0.05


@dataclass
class TrackConfig:
    name: str = "offline"
    backend: str = "wandb"  # wandb | none
    mode: str = "offline"  # offline | online | disabled
    project: str = "dsaflow"
    entity: Optional[str] = None
    run_name: Optional[str] = None
    tags: List[str] = field(default_factory=list)
    group: Optional[str] = None  # wandb group; a multirun sets it to the sweep's name unless given


@dataclass
class ServeConfig:
    checkpoint: Optional[str] = None
    prompts: List[str] = field(default_factory=list)
    prompts_file: Optional[str] = None
    output_file: Optional[str] = None
    max_new_tokens: int = 32
    max_batch: int = 8
    max_context: int = 512
    prefill_chunk: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    eos_id: Optional[int] = None  # stop a row at this token id (one small host sync per decode step when set)
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16: weights, caches and activations


@dataclass
class SearchConfig:
    """`dsaflow search`: the training-free greedy IndexCache layer search (docs/search.md)."""

    checkpoint: Optional[str] = None  # run dir (latest checkpoint) or checkpoint folder of an index=all_full run
    ratio: float = 0.25  # stop at round(ratio x layers) F layers ...
    target_f: Optional[int] = None  # ... or at exactly this many (wins over ratio)
    calib_batches: int = 8  # calibration batches (training split, never trained on) of train.batch_size x seq_len
    eval_batches: int = 16  # held-out batches for the all-F / uniform / searched table (0 = no table)
    eval_ratios: List[float] = field(default_factory=lambda: [0.5, 0.25])
    out_dir: Optional[str] = None  # default <run dir>/search
    device: str = "auto"  # auto | cpu | cuda
    restart: bool = False  # discard an earlier search log in out_dir instead of resuming it


@dataclass
class DSAFlowConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    graphs: GraphsConfig = field(default_factory=GraphsConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    track: TrackConfig = field(default_factory=TrackConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    layout: Optional[str] = None  # e.g. "(FSSS)*2 | (FSSS)*2": roles and stage boundaries in one string
    mode: str = "train"  # train | serve: which graph blocks make sense
    run_dir: Optional[str] = None  # default: runs/<timestamp>
    estimate_context: int = 131072  # context (keys per query) at which the plan reports indexer FLOPs saved by S layers
    extra: Any = None  # free-form user metadata, logged with the run


def register_configs() -> None:
    """Register the schema with Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="dsaflow_schema", node=DSAFlowConfig)
