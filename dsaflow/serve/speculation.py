"""The acceptance rules of speculative decoding: which of K drafted tokens a verify pass keeps, and the token after.

A verify pass feeds each row [last token, d_1, ..., d_K] and gives the target's distribution at each of the K + 1
positions: position j predicts the token after d_j (position 0 the token after the last one). The row keeps the
longest prefix of drafts the rule accepts, n of them, plus one more token from the target at position n, so every
verify pass emits n + 1 tokens (1 <= n + 1 <= K + 1).

- Greedy (temperature 0): d_j is accepted while it equals the target's argmax at position j - 1; the extra token is
  the argmax at position n. The output is the target's greedy sequence, whatever the drafts.
- Sampling (temperature > 0), the standard rule (Leviathan et al. 2023, Chen et al. 2023): d_j, drawn from the
  draft's q_j, is accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection the extra token is
  drawn from the residual max(p_n - q_n, 0) (normalised), and after K acceptances from p_K. Each emitted token is
  then distributed as the target's p, whatever q is.

Both are fixed-shape tensor ops (no host sync): `n` stays on the device until the scheduler needs it.
"""

from __future__ import annotations

import torch


def accept_greedy(target_logits: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target_logits [B, K + 1, V], drafts [B, K] int64 -> (n [B] int64, the drafts accepted; tokens [B, K + 1]:
    the row's emitted tokens are tokens[:n + 1] (the accepted drafts, then the target's own token))."""
    best = target_logits.argmax(dim=-1)
    K = drafts.shape[1]
    n = (best[:, :K] == drafts).long().cumprod(dim=1).sum(dim=1)
    return n, best


def accept_sampled(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    drafts: torch.Tensor,
    uniforms: torch.Tensor,
    race: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs [B, K + 1, V] (p_0 .. p_K), draft_probs [B, K, V] (the q_j each d_j was drawn from), drafts
    [B, K] int64, uniforms [B, K] in (0, 1) (one acceptance draw per draft), race [B, V] Exp(1) draws (the extra
    token, by the exponential race argmax(dist / E)) -> (n [B] int64, tokens [B, K + 1]: the accepted drafts, the
    extra token at index n, and drafts after it that are not emitted)."""
    B, K = drafts.shape
    p_d = target_probs[:, :K].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    q_d = draft_probs.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    accepted = uniforms * q_d <= p_d  # u < p / q without dividing by a q of 0
    n = accepted.long().cumprod(dim=1).sum(dim=1)
    residual = (target_probs[:, :K] - draft_probs).clamp_min(0)
    # after K acceptances the target's own p_K; a residual of all zeros (p == q) is never used: n < K needs a rejection
    dist = torch.cat([residual, target_probs[:, K:]], dim=1)[torch.arange(B, device=n.device), n]
    extra = (dist / race.clamp_min(torch.finfo(race.dtype).tiny)).argmax(dim=-1)
    tokens = torch.cat([drafts, drafts[:, :1]], dim=1).scatter(1, n.unsqueeze(1), extra.unsqueeze(1))
    return n, tokens
