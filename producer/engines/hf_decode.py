"""The hf engine's decode batch: the rows (samples) of every running request in one
KV cache, one forward pass a step, sampling and logprobs on the device and one host
sync a step. Used only from the engine's decode thread.

Requests join at a step boundary: their prompts are prefilled together (left-padded
when their lengths differ) and the new rows merged into the running batch, the
shorter cache padded on the left and masked. Rows leave when their request ends
(finished, aborted), by index selection of the cache. A cache that cannot be merged
(not a plain DynamicCache of full-attention layers) keeps its requests in a batch of
their own: the engine then steps its batches in turn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rollstream.producer.engines.base import SamplingParams


@dataclass(slots=True, eq=False)
class Row:
    """One sample of one request: what it has produced so far."""

    owner: Any  # the engine's request record
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reason: str | None = None
    text: str | None = None  # the text cut after a stop string


@dataclass(slots=True, eq=False)
class Batch:
    rows: list[Row]
    cache: Any
    inputs: torch.Tensor  # [B, 1] the last token of each row (or the prompts, before prefill)
    mask: torch.Tensor | None  # [B, L] 1 for real tokens, None when no row is padded
    positions: torch.Tensor | None  # [B] position id of the next token, None when aligned
    sampling: Sampling

    def __len__(self) -> int:
        return len(self.rows)


@dataclass(slots=True, eq=False)
class Sampling:
    """Per-row sampling parameters as device tensors, built when the rows change."""

    temperature: torch.Tensor  # [B, 1] (1 where greedy)
    greedy: torch.Tensor  # [B] bool
    top_p: torch.Tensor | None  # [B, 1], None when every row keeps the whole distribution
    all_greedy: bool
    any_greedy: bool
    unit_temperature: bool
    # (first row, row count, generator) of the rows whose request has a seed
    generators: list[tuple[int, int, torch.Generator]]


def sampling_for(
    rows: list[Row], params_of: Callable[[Any], SamplingParams], device: torch.device
) -> Sampling:
    temps, greedy, top_ps = [], [], []
    generators: list[tuple[int, int, torch.Generator]] = []
    previous: Any = None
    for i, row in enumerate(rows):
        params = params_of(row.owner)
        temps.append(params.temperature if params.temperature > 0 else 1.0)
        greedy.append(params.temperature <= 0)
        top_ps.append(params.top_p)
        generator = row.owner.generator
        if generator is not None:
            if row.owner is previous:
                first, count, _ = generators[-1]
                generators[-1] = (first, count + 1, generator)
            else:
                generators.append((i, 1, generator))
        previous = row.owner
    return Sampling(
        temperature=torch.tensor(temps, dtype=torch.float32, device=device).unsqueeze(1),
        greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
        top_p=None if all(p >= 1.0 for p in top_ps) else torch.tensor(top_ps, device=device).unsqueeze(1),
        all_greedy=all(greedy),
        any_greedy=any(greedy),
        unit_temperature=all(t == 1.0 for t in temps),
        generators=generators,
    )


def sample(logits: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token of each row and its logprob under the raw (untempered) distribution,
    both still on the device. Sampling is by the inverse of the cumulative distribution
    (one uniform number a row, a cumsum and a search): an exact draw from p that costs a
    fraction of ``torch.multinomial``'s exponential race over the whole vocabulary, and
    each seeded request's number comes from its own generator, so its draws do not
    depend on the rows beside it."""
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    if sampling.all_greedy:
        chosen = logits.argmax(dim=-1)
    else:
        if sampling.unit_temperature:  # the raw distribution: exp of the logprobs at hand
            probs = logp.exp()
        else:
            probs = torch.softmax(logits / sampling.temperature, dim=-1)
        if sampling.top_p is not None:
            probs = top_p(probs, sampling.top_p)
        cdf = probs.to(torch.float64).cumsum_(dim=-1)
        u = torch.rand(len(cdf), dtype=torch.float64, device=cdf.device)
        for first, count, generator in sampling.generators:
            u[first : first + count] = torch.rand(
                count, dtype=torch.float64, device=cdf.device, generator=generator
            )
        drawn = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        drawn = drawn.clamp_(max=cdf.shape[-1] - 1)
        chosen = torch.where(sampling.greedy, logits.argmax(dim=-1), drawn) if sampling.any_greedy else drawn
    return chosen, logp.gather(1, chosen.unsqueeze(1)).squeeze(1)


@torch.no_grad()
def step(model: Any, batch: Batch, counts: list[int] | None = None) -> tuple[list[float], list[float]]:
    """One forward pass of the batch and the next token of each row, with its logprob:
    one host sync. ``counts``: a prefill of the batch's prompts, each repeated for its
    request's n samples (the prompt's prefill runs once)."""
    mask, positions = batch.mask, None
    if counts is None and mask is not None:
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
        positions = batch.positions.unsqueeze(1) if batch.positions is not None else None
    elif mask is not None:
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    out = model(
        input_ids=batch.inputs,
        past_key_values=batch.cache,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
    )
    logits = out.logits[:, -1, :]
    batch.cache = out.past_key_values
    if counts is not None and (len(counts) != logits.shape[0] or any(c != 1 for c in counts)):
        index = torch.repeat_interleave(
            torch.arange(len(counts), device=logits.device), torch.tensor(counts, device=logits.device)
        )
        logits = logits[index]
        batch.cache.batch_select_indices(index)
        if mask is not None:
            mask = mask[index]
    if counts is not None:
        batch.positions = None if mask is None else mask.sum(dim=1)
    elif batch.positions is not None:
        batch.positions = batch.positions + 1
    batch.mask = mask
    chosen, logprobs = sample(logits, batch.sampling)
    batch.inputs = chosen.unsqueeze(1)
    host = torch.stack([chosen.double(), logprobs.double()]).tolist()
    return host[0], host[1]


def top_p(probs: torch.Tensor, keep: torch.Tensor | float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (the first
    token always stays); ``keep`` per row ([B, 1]) or one for all."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the tokens ranked above
    sorted_probs = sorted_probs.masked_fill(before >= keep, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def prompt_batch(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The prompts left-padded into one tensor, with the attention mask when any is padded."""
    width = max(len(p) for p in prompts)
    if all(len(p) == width for p in prompts):
        return torch.tensor(prompts, dtype=torch.long, device=device), None
    ids = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids, mask


def mergeable(cache: Any) -> bool:
    """A plain DynamicCache whose layers hold full keys and values (no sliding window)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    return type(cache) is DynamicCache and all(type(layer) is DynamicLayer for layer in cache.layers)


def cache_length(cache: Any) -> int:
    return int(cache.get_seq_length())


def merge(a: Batch, b: Batch) -> Batch:
    """b's rows appended to a's, in one cache: the shorter history padded on the left."""
    la, lb = cache_length(a.cache), cache_length(b.cache)
    width = max(la, lb)
    device = a.inputs.device
    for mine, theirs in zip(a.cache.layers, b.cache.layers, strict=True):
        mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)], dim=0)
        mine.values = torch.cat([_left_pad(mine.values, width), _left_pad(theirs.values, width)], dim=0)
    masks = [_full_mask(x, length, width, device) for x, length in ((a, la), (b, lb))]
    mask = torch.cat(masks, dim=0)
    positions = torch.cat([_positions(a, la), _positions(b, lb)], dim=0)
    a.rows.extend(b.rows)
    a.inputs = torch.cat([a.inputs, b.inputs], dim=0)
    a.positions = positions
    a.mask = None if bool(mask.all()) else mask
    if a.mask is None:
        a.positions = None
    return a


def select(batch: Batch, keep: list[int]) -> None:
    """Only the rows ``keep`` stay in the batch (and its cache)."""
    index = torch.tensor(keep, dtype=torch.long, device=batch.inputs.device)
    batch.cache.batch_select_indices(index)
    batch.rows = [batch.rows[i] for i in keep]
    batch.inputs = batch.inputs[index]
    if batch.mask is not None:
        batch.mask = batch.mask[index]
        first = int(batch.mask.sum(dim=0).nonzero()[0]) if batch.mask.any() else 0
        if first:  # columns no row attends to any more: out of the cache
            for layer in batch.cache.layers:
                layer.keys = layer.keys[:, :, first:]
                layer.values = layer.values[:, :, first:]
            batch.mask = batch.mask[:, first:]
        if bool(batch.mask.all()):
            batch.mask = None
    if batch.positions is not None:
        batch.positions = batch.positions[index]
        if batch.mask is None:
            batch.positions = None


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    pad = width - t.shape[-2]
    if pad == 0:
        return t
    zeros = torch.zeros((*t.shape[:-2], pad, t.shape[-1]), dtype=t.dtype, device=t.device)
    return torch.cat([zeros, t], dim=-2)


def _full_mask(batch: Batch, length: int, width: int, device: torch.device) -> torch.Tensor:
    mask = batch.mask
    if mask is None:
        mask = torch.ones((len(batch), length), dtype=torch.long, device=device)
    if width > mask.shape[1]:
        zeros = torch.zeros((len(batch), width - mask.shape[1]), dtype=torch.long, device=device)
        mask = torch.cat([zeros, mask], dim=1)
    return mask


def _positions(batch: Batch, length: int) -> torch.Tensor:
    if batch.positions is not None:
        return batch.positions
    return torch.full((len(batch),), length, dtype=torch.long, device=batch.inputs.device)
