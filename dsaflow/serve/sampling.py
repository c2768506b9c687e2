"""Next-token sampling on the device, with no host sync: greedy, temperature and top-p.

Everything is a fixed-shape tensor op (sort, cumsum, where, scatter, argmax), so a step never waits on the host and
the same code could sit inside a CUDA graph. Randomness comes from a seeded `torch.Generator` on the logits' device:
sampling from `p` is done by the exponential race `argmax(p / E)` with `E ~ Exp(1)` i.i.d., which picks token i with
probability p_i (the Gumbel-max trick in another form) and needs no `torch.multinomial` (whose CUDA kernel may sync).
"""

from __future__ import annotations

import torch


def top_p_mask(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [B, V] (rows sum to 1) -> bool [B, V]: True for the smallest set of most likely tokens whose mass
    reaches top_p (the nucleus). The most likely token is always kept, so a row is never empty.

    Branchless: sort descending, keep token j iff the mass strictly before it is < top_p, scatter back.
    """
    sorted_p, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    keep_sorted = mass_before < top_p
    keep_sorted[:, 0] = True  # the argmax survives any top_p > 0 (and rounding in cumsum)
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def sample_next(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """logits [B, V] fp32 -> token ids [B] int64.

    temperature == 0 -> greedy argmax (ties resolve to the lowest id). Otherwise softmax(logits / temperature),
    restricted to the top-p nucleus when top_p < 1, sampled by the exponential race with `generator`. `temperature`
    and `top_p` are host floats (from the config), so choosing the branch never reads the device.
    """
    race = lambda probs: torch.empty_like(probs).exponential_(generator=generator)  # noqa: E731
    return _race_sample(logits, temperature, top_p, race, "sample_next")


def _race_sample(logits: torch.Tensor, temperature: float, top_p: float, draw_race, name: str) -> torch.Tensor:
    """The shared body: greedy at temperature 0, else argmax(p / E) over the (top-p cut) softmax, with E ~ Exp(1)
    from `draw_race(probs)`."""
    if temperature < 0 or not (0.0 < top_p <= 1.0):
        raise ValueError(f"{name}: temperature must be >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        probs = torch.where(top_p_mask(probs, top_p), probs, torch.zeros_like(probs))
    race = draw_race(probs)
    # An Exp(1) draw can round to exactly 0; 0/0 = NaN would win argmax for a masked token.
    return (probs / race.clamp_min(torch.finfo(race.dtype).tiny)).argmax(dim=-1)


def make_generator(device: torch.device | str, seed: int) -> torch.Generator:
    """A generator on `device` seeded with `seed`: same seed, same device type -> same samples."""
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(int(seed))
    return gen


TOKEN_KEY = 1 << 24  # serving's sampling key = request index * TOKEN_KEY + token index (`sample_keyed`)
_MASK63 = (1 << 63) - 1


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 64-bit integer hash (splitmix64's finaliser, on int64 with wrap-around, kept non-negative)."""
    x = x & _MASK63
    x = ((x ^ (x >> 31)) * 0x5BD1E995) & _MASK63
    x = ((x ^ (x >> 29)) * 0x27D4EB2F165667C5) & _MASK63
    return x ^ (x >> 32)


def keyed_uniform(seed: int, keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys [B] int64 -> uniforms [B, vocab] fp32 in (0, 1), a pure function of (seed, key, column): a row's draws
    do not depend on which other rows share its batch or on how many draws came before."""
    cols = torch.arange(vocab, device=keys.device, dtype=torch.long)
    x = _mix(_mix(keys.view(-1, 1) * 0x100000001B3 + int(seed) % (1 << 40)) + cols.view(1, -1))
    return (((x >> 8) & 0xFFFFFF).float() + 0.5) / float(1 << 24)


def sample_keyed(logits: torch.Tensor, temperature: float, top_p: float, seed: int, keys: torch.Tensor) -> torch.Tensor:
    """Like `sample_next`, with the exponential race drawn from `keyed_uniform(seed, keys)`: logits [B, V],
    keys [B] int64 (serving uses request index x 2^24 + token index) -> token ids [B]. Sampling a request then
    gives the same tokens whatever the batch, the microbatch groups or the pipeline split."""
    race = lambda probs: -torch.log(keyed_uniform(seed, keys, probs.shape[-1]))  # noqa: E731
    return _race_sample(logits, temperature, top_p, race, "sample_keyed")


def sample_rowwise(logits: torch.Tensor, params: torch.Tensor, seed: int) -> torch.Tensor:
    """Each row with its own settings (online serving: one request per row): logits [B, V] fp32, params [B, 3]
    int64 = (key, float64 bits of temperature, float64 bits of top_p) -> token ids [B]. A row at temperature 0 takes
    the argmax; the others race as `sample_keyed` does, with their own temperature and nucleus. Branchless (the
    choice is a `where` over both results), so a decode graph can hold it."""
    keys = params[:, 0].contiguous()
    temperature = params[:, 1].contiguous().view(torch.float64).float().unsqueeze(1)  # [B, 1]
    top_p = params[:, 2].contiguous().view(torch.float64).float().unsqueeze(1)
    greedy = logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature.clamp_min(1e-6), dim=-1)
    probs = torch.where(top_p_mask(probs, top_p), probs, torch.zeros_like(probs))
    race = -torch.log(keyed_uniform(seed, keys, logits.shape[-1]))
    sampled = (probs / race.clamp_min(torch.finfo(race.dtype).tiny)).argmax(dim=-1)
    return torch.where(temperature[:, 0] > 0, sampled, greedy)


def sample_message(
    logits: torch.Tensor, keys: torch.Tensor | None, *, temperature: float, top_p: float, seed: int, eos_id: int | None
):
    """The last stage's sampling of one serving pass: logits [rows, V] (each row's sampled column) -> (message
    [rows, 2] int64: tokens, EOS flags (0 without an eos_id); the fp32 logits [rows, V]). Fixed-shape ops only, so
    the last stage's decode graphs run it inside the graph."""
    picked = logits.float()
    if keys is not None and keys.dim() == 2:  # per-request sampling: [rows, 3] (key, temperature, top_p)
        tok = sample_rowwise(picked, keys, seed)
    elif temperature == 0:  # greedy: the argmax (what the race gives at temperature 0), without its call chain
        tok = picked.argmax(dim=-1)
    else:
        tok = sample_keyed(picked, temperature, top_p, seed, keys)
    flags = (tok == eos_id).long() if eos_id is not None else torch.zeros_like(tok)
    return torch.stack([tok, flags], dim=1), picked
