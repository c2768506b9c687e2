"""Multi-token prediction (DeepSeek-V3 section 2.2): the MTP layers that follow the model's last layer.

MTP layer k (1-based depth, global index `num_layers + k - 1`) predicts the token k + 1 places after each position:

    h_k[i] = head_norm( block( eh_proj([enorm(embed(t[i + k])) ; hnorm(h_{k-1}[i])]) ) )
    logits_k[i] = head(h_k[i])                                    # predicts t[i + k + 1]

h_0 = norm(h_main) is the main model's output representation (what its head reads). `block` is one DSA block of the
model's kind (MLA with its own lightning indexer, an F layer; a MoE MLP where the model has MoE layers), `head` is the
main model's LM head (the same module), and `head_norm` is the checkpoints' `shared_head.norm`. The normed embedding
comes first in the concatenation, as the released checkpoints' eh_proj expects.

Where it lives: on the last stage, next to the head. The embedding lives on the first stage, so each MTP layer holds
its own copy (`embed`, as the checkpoints store it: `model.layers.N.embed_tokens`). A run of ours initialises it equal
to the main embedding (the same seeded draw); training then updates the two copies separately, at every pipeline
split alike. The planner counts the copy on the last stage.

In training, depth k at position i reads t[i + k] from the microbatch's input tokens and learns t[i + k + 1]; the
last k positions of a sequence have no such token and are ignored by the loss. Its query position is i (the position
of the hidden state it extends), in training and in serving alike, so a serving cache's MTP row at position i holds
the layer's keys of (h[i], t[i + 1]).
"""

from __future__ import annotations

import torch
from torch import nn

from dsaflow.config.schema import ModelConfig

from .block import DSABlock
from .context import ForwardContext
from .layer_spec import LayerSpec
from .norms import RMSNorm


def mtp_layer_indices(cfg: ModelConfig) -> list[int]:
    """The global indices of the model's MTP layers: num_layers, num_layers + 1, ... (`model.mtp_layers` of them)."""
    return list(range(cfg.num_layers, cfg.num_layers + cfg.mtp_layers))


class MTPLayer(DSABlock):
    """One MTP depth: a DSA block (an F layer at global index `index`) plus the input and output projections of
    the module docstring. State-dict keys under the stage's `mtp.{index}.`: the block's own (attn_norm, attn.*,
    ffn_norm, mlp.*) and embed, enorm, hnorm, eh_proj, head_norm."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, LayerSpec(index, "F", index))
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.head_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def predict(self, h_prev: torch.Tensor, tokens: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """h_prev [B, T, dim] (the previous depth's normed output), tokens [B, T] int64 (the token after the one
        each position's hidden state ended on) -> this depth's normed output [B, T, dim], what the head reads."""
        x = torch.cat([self.enorm(self.embed(tokens)), self.hnorm(h_prev)], dim=-1)
        return self.head_norm(DSABlock.forward(self, self.eh_proj(x), ctx))


def mtp_inputs(tokens: torch.Tensor, depth: int) -> torch.Tensor:
    """A training microbatch's input ids [B, T] -> the ids MTP depth `depth` reads [B, T]: t[i + depth], with 0
    where the sequence has no such token (those positions are ignored by `mtp_targets`)."""
    out = torch.zeros_like(tokens)
    out[:, : tokens.shape[1] - depth] = tokens[:, depth:]
    return out


def mtp_targets(lm_targets: torch.Tensor, depth: int, ignore: int) -> torch.Tensor:
    """The LM targets [B, T] (target[i] = t[i + 1]) -> what depth `depth` learns at position i: t[i + depth + 1],
    i.e. lm_targets[i + depth], and `ignore` in the last `depth` positions."""
    out = torch.full_like(lm_targets, ignore)
    out[:, : lm_targets.shape[1] - depth] = lm_targets[:, depth:]
    return out


def mtp_runs_in_training(cfg) -> bool:
    """Whether training runs the MTP layers (cfg: the whole config): model.mtp_layers > 0 and parallel.cp == 1.
    Depth k reads the token k places ahead, which under parallel.cp lies in another rank's zigzag chunk at the
    chunk's last k positions; the planner admits MTP layers with cp only at train.mtp_loss_weight=0
    (dsaflow/plan/cp_rules.py), and training then carries them through untouched (no forward, no gradient)."""
    return cfg.model.mtp_layers > 0 and cfg.parallel.cp == 1
