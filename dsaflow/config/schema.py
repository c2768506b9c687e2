"""Typed config schema: the one place a field, its type, its allowed values or range, and its default are declared.

Hydra merges the YAML files of `configs/` into these dataclasses. Choice fields are `Choice` enums (OmegaConf
structured configs check them), numeric fields carry a range in their metadata (`num(default, lo, hi)`), and
`validate(cfg)` checks every range, so an unknown key, a wrong type, a bad choice or an out-of-range number fails at
compose time with a message naming the field, the value and what is allowed. Defaults here are the embedded default
run (CPU-sized); `configs/model/tiny.yaml` only names them.

Ownership: each group's dataclass is the single place its fields are declared; the planner (`dsaflow.plan`) checks
only cross-field rules. Upper bounds are sizes no machine can hold (they stop a typo such as an extra zero); what
fits a given machine is the launcher's pre-launch resource check."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, List, Optional

from dsaflow.errors import ConfigError

from .field_checks import check_fields
from .fields import Choice, make_choice, num
from .moe_schema import MoEConfig, check_moe
from .parallel_schema import ParallelConfig
from .plan_schema import PlanConfig
from .rope_schema import YarnConfig
from .server_schema import ServerConfig

Schedule = make_choice(
    "Schedule", ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"], __name__
)
Balance = make_choice("Balance", ["cost", "layers"], __name__)
BlockKind = make_choice("BlockKind", ["decode", "prefill", "mixed", "head", "layers"], __name__)
OnFailure = make_choice("OnFailure", ["error", "eager"], __name__)
DsaStage = make_choice("DsaStage", ["dense_warmup", "sparse"], __name__)
TrainDtype = make_choice("TrainDtype", ["auto", "fp32", "bf16"], __name__)
Recompute = make_choice("Recompute", ["none", "attention", "block"], __name__)
Device = make_choice("Device", ["auto", "cpu", "cuda"], __name__)
ProgressMode = make_choice("ProgressMode", ["auto", "rich", "lines", "off"], __name__)
DataKind = make_choice("DataKind", ["retrieval", "text", "bin"], __name__)
LossOn = make_choice("LossOn", ["answer", "all"], __name__)
CopyChars = make_choice("CopyChars", ["filler", "mixed"], __name__)
DataSplit = make_choice("DataSplit", ["tail", "files"], __name__)
TrackBackend = make_choice("TrackBackend", ["wandb", "none"], __name__)
TrackMode = make_choice("TrackMode", ["offline", "online", "disabled"], __name__)
Mode = make_choice("Mode", ["train", "serve"], __name__)
Batching = make_choice("Batching", ["fixed", "continuous"], __name__)
OnNonFinite = make_choice("OnNonFinite", ["stop", "skip"], __name__)
ServeWeights = make_choice("ServeWeights", ["bf16", "fp8"], __name__)
KvDtype = make_choice("KvDtype", ["bf16", "fp8"], __name__)

BIG = 1 << 31  # int32 sizes: beyond this an index tensor or an embedding row id overflows


@dataclass
class ModelConfig:
    """DSA transformer shapes (DeepSeek-V3.2 naming). MLA in MQA mode: one latent row of
    `kv_lora_rank + qk_rope_head_dim` per token is shared by all heads. These defaults are `model=tiny`."""

    name: str = "tiny"
    num_layers: int = num(8, 1, 1024)
    dim: int = num(64, 1, 65536)
    n_heads: int = num(4, 1, 1024)
    q_lora_rank: int = num(32, 1, 65536)
    kv_lora_rank: int = num(32, 1, 65536)
    qk_nope_head_dim: int = num(16, 1, 4096)
    qk_rope_head_dim: int = num(8, 2, 4096, even=True, why="RoPE rotates pairs")
    v_head_dim: int = num(16, 1, 4096)
    index_n_heads: int = num(4, 1, 1024)
    index_head_dim: int = num(16, 1, 4096)
    # RoPE is applied to the first `index_rope_head_dim` dims of index q/k (<= index_head_dim: a planner rule)
    index_rope_head_dim: int = num(8, 0, 4096, even=True, why="RoPE rotates pairs")
    index_topk: int = num(16, 1, 65536, why="the keys each query attends to, e.g. 2048")
    # the top-k's logits from per-row-scaled fp8 (e4m3) q and k, as DeepSeek-V3.2 runs its indexer: about 2x the
    # logits' speed on Hopper (fp8 tensor cores; CUDA needs compute capability 8.9+), the same rounding on CPU; the
    # indexer loss keeps its own bf16/fp32 scores
    index_fp8: bool = False
    inter_dim: int = num(128, 1, 1 << 20)  # the dense SwiGLU's hidden size (every layer's MLP unless `moe` is set)
    vocab_size: int = num(256, 1, 1 << 21)
    max_seq_len: int = num(1024, 1, 1 << 22)
    rope_theta: float = num(10000.0, 0, 1e12, lo_open=True)
    norm_eps: float = num(1e-6, 0, 1, lo_open=True, hi_open=True)
    # eps of MLA's q/kv latent RMSNorms (None = norm_eps) and of the indexer's key LayerNorm: Hugging Face's
    # DeepSeek-V3.2 and GLM-5 use 1e-6 for both, whatever their rms_norm_eps
    latent_norm_eps: Optional[float] = num(None, 0, 1, lo_open=True, hi_open=True)
    index_norm_eps: float = num(1e-5, 0, 1, lo_open=True, hi_open=True)
    rope_scaling: Optional[YarnConfig] = None  # YaRN (dsaflow/config/rope_schema.py); None = plain RoPE
    tie_embeddings: bool = False
    # multi-token-prediction layers after the last layer, on the last stage (dsaflow/model/mtp.py; config.json's
    # num_nextn_predict_layers); 0 = none
    mtp_layers: int = num(0, 0, 16)
    init_std: float = num(0.02, 0, 1, lo_open=True)
    # mixture-of-experts MLPs (DeepSeek-V3 / GLM-5 recipe); None = every layer dense (dsaflow/config/moe_schema.py)
    moe: Optional[MoEConfig] = None
    # a Hugging Face checkpoint folder (`model=hf`): its config.json sets these fields at compose time, and its
    # weights load when no serve.checkpoint / train.init_from is given (dsaflow/checkpoint/)
    hf_path: Optional[str] = None


@dataclass
class IndexConfig:
    """Which layers are F (run the indexer) and which are S (reuse the nearest preceding F on the stage).

    Exactly one of: top-level `layout`, `pattern` (tiled over the layers), or `freq` (+ `offset`):
    layer i is F iff i < offset or (i - offset) % freq == 0. None of them set means every layer is F."""

    name: str = "all_full"
    pattern: Optional[str] = None
    freq: Optional[int] = num(None, 1, 1024)
    offset: int = num(0, 0, 1024)
    # true: an S layer that opens a stage (with no indices arriving from the previous stage) runs as F, which needs
    # indexer weights on it. false: S layers have no indexer weights (models trained with index sharing, such as
    # GLM-5.2, ship none): stages must start on F, or pipeline.cross_stage_indices must carry the indices across.
    promote: bool = True


@dataclass
class PipelineConfig:
    """Stage boundaries and schedule. `boundaries` lists the first layer of each stage after the first (or each
    stage, starting at 0); otherwise `stages` stages are cut by `balance` (cost | layers)."""

    name: str = "single"
    stages: int = num(1, 1, 1024)
    boundaries: Optional[List[int]] = None
    balance: Balance = Balance.cost
    ranks: Optional[int] = num(None, 1, 4096)  # pipeline ranks; None = stages (one stage per rank)
    schedule: Schedule = Schedule["1F1B"]
    microbatches: Optional[int] = num(None, 1, 65536)  # None = one per stage (1 on one stage: no grad accumulation)
    # send each stage's top-k indices (int32 [B, T, topk], no gradient) with the activations, so that the S layers
    # opening the next stage read the nearest preceding F of the whole model instead of being promoted to F
    cross_stage_indices: bool = False


@dataclass
class GraphBlockConfig:
    """A region to capture as a CUDA graph on every device that owns it, once per shape class.

    kind: decode | prefill | mixed | head | layers. `layers` = [first, last] (inclusive) for kind=layers; mixed =
    serving's token-major mixed passes (serve.max_pass_tokens), one class per padded token count."""

    name: str = "decode"
    kind: BlockKind = BlockKind.decode
    layers: Optional[List[int]] = None
    shape_classes: List[int] = field(default_factory=lambda: [1, 2, 4, 8])


@dataclass
class GraphsConfig:
    name: str = "off"
    enabled: bool = False
    blocks: List[GraphBlockConfig] = field(default_factory=list)
    max_shape: int = num(256, 1, 65536)  # largest allowed shape class (batch for decode, tokens for prefill)
    cache: bool = True  # false = debug bypass: evict before lookup, capture afresh on every call
    on_failure: OnFailure = OnFailure.error
    transfers: bool = False  # serving on NCCL: decode ticks' transfers replayed from CUDA graphs (transfer_graphs.py)


@dataclass
class TrainConfig:
    """Optimisation, the DSA recipe, eval, checkpoints. Defaults: the embedded main job (retrieval, 2-core CPU)."""

    name: str = "default"
    steps: int = num(300, 1, 10**9)
    seed: int = num(0, 0, 2**63 - 1)
    seq_len: int = num(128, 1, 1 << 22)
    batch_size: int = num(16, 1, 1 << 20)  # sequences per step (split into pipeline.microbatches)
    lr: float = num(3e-3, 0, 10, lo_open=True)
    min_lr_ratio: float = num(0.1, 0, 1)
    warmup_steps: int = num(20, 0, 10**9)
    weight_decay: float = num(0.1, 0, 10)
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])  # two values in [0, 1) (checked in validate)
    # global norm over every stage (main and indexer params clipped separately); 0 = off
    grad_clip: float = num(1.0, 0, 1e6)
    on_nonfinite: OnNonFinite = OnNonFinite.stop  # a NaN/inf loss or grad norm: stop the run | skip the step
    dsa_stage: DsaStage = DsaStage.sparse
    dense_warmup_steps: int = num(0, 0, 10**9)  # steps of dense_warmup before `sparse` (when dsa_stage=sparse)
    indexer_lr: float = num(1e-3, 0, 10)
    indexer_loss_weight: float = num(1.0, 0, 1e6)
    # the MTP layers' mean cross-entropy joins the loss with this weight (model.mtp_layers > 0; DeepSeek-V3 uses 0.1
    # late in training); logged as `mtp_loss`
    mtp_loss_weight: float = num(0.1, 0, 1e6)
    dtype: TrainDtype = TrainDtype.auto  # auto (bf16 autocast on GPU, fp32 on CPU) | fp32 | bf16
    # Fixed reduction orders instead of atomics (sparse-attention backward, torch ops that have a deterministic
    # implementation): repeated runs give bit-identical results; slower (docs/training.md).
    deterministic: bool = False
    # none | attention: keep only each layer's attention inputs for backward and recompute the absorbed query, the
    # sparse attention and its output projection there (-2 * H * kv_lora bf16 per token per layer) | block: keep
    # only each layer's input and recompute the whole layer in backward (the fewest activations; docs/training.md)
    recompute: Recompute = Recompute.none
    # queries per recomputed attention chunk: bounds one layer's backward transient (docs/training.md)
    recompute_chunk_tokens: int = num(16384, 1, 1 << 22)
    # tokens per chunk of the last stage's norm + LM head + cross-entropy (forward and backward): the [tokens, vocab]
    # logits never exist at once, only one chunk's (docs/training.md, "Long context")
    loss_chunk_tokens: int = num(2048, 1, 1 << 22)
    log_every: int = num(10, 1, 10**9)
    eval_every: int = num(50, 0, 10**9)  # 0 = only at the end
    eval_batches: int = num(4, 1, 10**6)
    ckpt_every: int = num(0, 0, 10**9)  # 0 = only at the end
    keep_checkpoints: int = num(3, 1, 10**6)  # the newest N complete checkpoints are kept, older ones removed
    final_ckpt: bool = True  # save a checkpoint after the last step (benchmarks turn it off)
    resume: bool = False  # continue from the newest good checkpoint in run_dir
    # a new run from another run's model weights (its run dir or a checkpoint folder): fresh optimiser and schedule;
    # the same model but model.index_topk / index_fp8, and S layers may drop their indexers (docs/training.md)
    init_from: Optional[str] = None
    stop_at_step: Optional[int] = num(None, 1, 10**9)  # pre-emption drill: exit after this step, no final ckpt
    device: Device = Device.auto
    # torch threads per CPU rank: tiny models gain nothing from more, oversubscription costs 100x
    cpu_threads: int = num(1, 1, 1024)
    peak_tflops: Optional[float] = num(None, 0, 1e6, lo_open=True)  # per-rank peak for MFU; None = known table
    progress: ProgressMode = ProgressMode.auto  # auto (rich bar on a TTY, lines otherwise) | rich | lines | off


@dataclass
class DataConfig:
    name: str = "retrieval"
    kind: DataKind = DataKind.retrieval
    path: Optional[str] = None  # text file/folder or nanoGPT-style .bin token file (uint16)
    num_pairs: int = num(1, 1, 1 << 20)  # retrieval: key-value pairs hidden in the filler (1 = needle in a haystack)
    num_queries: int = num(1, 1, 1 << 20)  # retrieval: queries at the end (keys drawn with replacement)
    distinct_queries: bool = False  # retrieval: each query asks a different pair (needs num_queries <= num_pairs)
    # retrieval: > 0 repeats a filler run of this many bytes later on and trains on the repeat (docs/training.md)
    copy_len: int = num(0, 0, 1 << 20)
    copy_chars: CopyChars = CopyChars.filler  # the run's bytes: the filler's, or mixed = [a-zA-Z0-9]
    key_len: int = num(1, 1, 64)
    value_len: int = num(1, 1, 4096)
    loss_on: LossOn = LossOn.answer  # retrieval: LM loss on the answer bytes only (answer) or on every byte (all)
    val_fraction: float = num(0.05, 0, 1, hi_open=True)
    # text folders: tail = hold out the last val_fraction of the joined bytes; files = hold out whole files (about
    # val_fraction of them, evenly spaced in sorted order), so evaluation reads files training never saw
    split: DataSplit = DataSplit.tail
    suffixes: Optional[List[str]] = None  # text folders: file suffixes to read, e.g. [.py]; None = .txt .md .text
    exclude: List[str] = field(default_factory=list)  # text folders: globs of relative paths to skip, e.g. [test/*]


@dataclass
class TrackConfig:
    name: str = "offline"
    backend: TrackBackend = TrackBackend.wandb
    mode: TrackMode = TrackMode.offline
    project: str = "dsaflow"
    entity: Optional[str] = None
    run_name: Optional[str] = None
    tags: List[str] = field(default_factory=list)
    group: Optional[str] = None  # wandb group; a multirun sets it to the sweep's name unless given


@dataclass
class ServeConfig:
    checkpoint: Optional[str] = None  # a run dir or a checkpoint folder (its weights-only model-rank*.safetensors)
    # each a string, or a list of token ids as in a prompts file's {"prompt": [0, 17, 4]} (dsaflow.serve.prompts)
    prompts: List[Any] = field(default_factory=list)
    prompts_file: Optional[str] = None
    output_file: Optional[str] = None
    max_new_tokens: int = num(32, 1, 1 << 22)
    max_batch: int = num(8, 1, 4096)
    # groups of rows in flight (stage s runs group g, s+1 runs g-1); None = one per rank; <= max_batch (checked)
    microbatches: Optional[int] = num(None, 1, 4096)
    batching: Batching = Batching.continuous  # continuous (refill finished rows at once) | fixed; docs/serving.md
    max_context: int = num(512, 1, 1 << 22)
    prefill_chunk: int = num(128, 1, 65536)  # the most prompt tokens of one row in one pass
    # mixed passes (continuous batching): each pass carries every decoding row's next token and prompt chunks of
    # joining rows, up to this many tokens in all, token-major (docs/serving.md, "Mixed passes"); None: a pass
    # either prefills or decodes
    max_pass_tokens: Optional[int] = num(None, 2, 65536)
    # on a GPU, the host builds a pass only once its GPU has finished the pass this many ticks earlier: a request
    # that arrives joins a pass that runs soon, not one behind a queue of launched ones (docs/serving.md, "Run-ahead");
    # None: the host runs as far ahead as its launch ring (64 passes) allows
    max_ticks_ahead: Optional[int] = num(3, 1, 64)
    temperature: float = num(0.0, 0, 100)  # 0 = greedy
    # speculative decoding: the MTP layer drafts this many tokens per decoding row, verified in one pass (needs
    # model.mtp_layers >= 1; docs/serving.md, "Speculative decoding"); 0 = off
    speculative_tokens: int = num(0, 0, 16)
    top_p: float = num(1.0, 0, 1, lo_open=True)
    seed: int = num(0, 0, 2**63 - 1)
    eos_id: Optional[int] = num(None, 0, 1 << 21)  # stop a row at this token id (one small host sync per step)
    dtype: TrainDtype = TrainDtype.auto  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16: weights, caches, activations
    short_prefill: bool = True  # dense / masked attention for short prefill passes (docs/serving.md); false: sparse
    # bf16: every weight in serve.dtype | fp8: the projections in e4m3 with 128x128 block scales, the embedding, head,
    # norms and indexer weights_proj in serve.dtype, the router in fp32 (dsaflow/config/fp8_policy.py)
    weights: ServeWeights = ServeWeights.bf16
    # bf16: the KV and indexer-key caches in serve.dtype | fp8: DeepSeek's layout, the latent in e4m3 with an fp32
    # scale per 128 values and its RoPE part in bf16, the indexer keys in e4m3 with one scale (docs/serving.md)
    kv_dtype: KvDtype = KvDtype.bf16


@dataclass
class SearchConfig:
    """`dsaflow search`: the training-free greedy IndexCache layer search (docs/search.md)."""

    checkpoint: Optional[str] = None  # run dir (latest checkpoint) or checkpoint folder of an index=all_full run
    ratio: float = num(0.25, 0, 1, lo_open=True)  # stop at round(ratio x layers) F layers ...
    target_f: Optional[int] = num(None, 1, 1024)  # ... or at exactly this many (wins over ratio)
    # calibration batches (training split, never trained on) of train.batch_size x seq_len
    calib_batches: int = num(8, 1, 10**6)
    eval_batches: int = num(16, 0, 10**6)  # held-out batches for the all-F / uniform / searched table (0 = no table)
    # F fractions of the uniform layouts in the table: each in (0, 1] (checked in validate)
    eval_ratios: List[float] = field(default_factory=lambda: [0.5, 0.25])
    out_dir: Optional[str] = None  # default <run dir>/search
    device: Device = Device.auto  # auto | cpu | cuda
    restart: bool = False  # discard an earlier search log in out_dir instead of resuming it


@dataclass
class LaunchConfig:
    """How long a launch waits for what it cannot control: peers, the rendezvous of several nodes."""

    # every wait on another process (process-group collectives and p2p, the multi-node rendezvous, a stopped
    # worker seen by the parent's watchdog) gives up after this many seconds with a message naming what it waited for
    timeout_s: int = num(600, 5, 7 * 86400)


@dataclass
class DSAFlowConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    graphs: GraphsConfig = field(default_factory=GraphsConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    track: TrackConfig = field(default_factory=TrackConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    server: ServerConfig = field(default_factory=ServerConfig)  # `dsaflow serve`'s HTTP front end
    search: SearchConfig = field(default_factory=SearchConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    layout: Optional[str] = None  # e.g. "(FSSS)*2 | (FSSS)*2": roles and stage boundaries in one string
    mode: Mode = Mode.train  # train | serve: which graph blocks make sense
    run_dir: Optional[str] = None  # default: runs/<timestamp>-<name>-<unique suffix>
    # context (keys per query) at which the plan reports indexer FLOPs saved by S layers
    estimate_context: int = num(131072, 1, 1 << 24)
    extra: Any = None  # free-form user metadata, logged with the run


def _fmt(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _check_range(path: str, v, spec) -> None:
    lo, hi, lo_open, hi_open, even, why = spec
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return  # a wrong type is OmegaConf's message (compose) or the caller's bug (configs built in code)
    bad = isinstance(v, float) and not math.isfinite(v)
    bad = (
        bad
        or (lo is not None and (v <= lo if lo_open else v < lo))
        or (hi is not None and (v >= hi if hi_open else v > hi))
    )
    if bad:
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        allowed = f"{left}{'-inf' if lo is None else _fmt(lo)}, {'inf' if hi is None else _fmt(hi)}{right}"
        hint = f" ({why})" if why else ""
        raise ConfigError(
            f"{path}={_fmt(v)} is out of range: allowed {allowed}{hint}. Fix: set {path} within {allowed}."
        )
    if even and int(v) % 2:
        raise ConfigError(f"{path}={v} must be even ({why}). Fix: use an even size, e.g. {path}={int(v) + 1}.")


def _check_choice(path: str, v, enum_type) -> None:
    names = [m.value for m in enum_type]
    if str(v) not in names:
        raise ConfigError(f"{path}={str(v)!r} is not a valid choice. Fix: use one of {', '.join(names)}.")


def validate(cfg, prefix: str = "") -> None:
    """Check every declared range and choice of a config (a DSAFlowConfig or any group); raises ConfigError naming
    the field, the value and what is allowed. Compose and load_config call it, and so does the planner, for
    configs built in code."""
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        path = f"{prefix}{f.name}"
        if v is None:
            continue
        if dataclasses.is_dataclass(v):
            validate(v, path + ".")
        elif isinstance(v, list) and v and dataclasses.is_dataclass(v[0]):
            for item in v:
                validate(item, f"{path}[{getattr(item, 'name', '?')}].")
        elif "range" in f.metadata:
            _check_range(path, v, f.metadata["range"])
        else:
            enum_type = _ENUM_FIELDS.get((type(cfg).__name__, f.name))
            if enum_type is not None:
                _check_choice(path, v, enum_type)
    if isinstance(cfg, ModelConfig) and cfg.moe is not None:
        check_moe(cfg.moe, cfg.num_layers)
    check_fields(cfg, prefix)  # names that become paths, tracker fields, list items: field_checks.py


def _enum_fields() -> dict:
    import typing

    out = {}
    for cls in [c for c in list(globals().values()) if isinstance(c, type) and dataclasses.is_dataclass(c)]:
        for name, hint in typing.get_type_hints(cls).items():
            if isinstance(hint, type) and issubclass(hint, Choice):
                out[(cls.__name__, name)] = hint
    return out


_ENUM_FIELDS = _enum_fields()


def choices(enum_type) -> tuple:
    """The allowed values of a Choice field, as plain strings."""
    return tuple(m.value for m in enum_type)


def register_configs() -> None:
    """Register the schema with Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="dsaflow_schema", node=DSAFlowConfig)
