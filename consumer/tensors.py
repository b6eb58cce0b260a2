"""A train batch as the tensors a causal language model trains on (needs torch: the hf
extra; torch is imported when a function here runs, so importing the module is free).

Layout. Each sample is one sequence ``prompt_ids + response_ids`` (length L = p + r).
Every per-token tensor has the shape of ``input_ids`` and is indexed by the position
of the *predicting* token: the logits at position t predict token t + 1, so

- ``targets[b, t] = input_ids[b, t + 1]`` inside a sequence, ``pad_id`` after its last
  token (nothing is predicted across a sequence's end);
- ``loss_mask[b, t]`` is True where ``targets[b, t]`` is a trained response token:
  positions ``p - 1 ... p + r - 2`` of the sequence (the last prompt token predicts the
  first response token; the last response token predicts nothing), less the tokens
  that the sample's stored ``loss_mask`` leaves out: an agent trajectory's response
  holds the environment's and tools' turns too, which the model did not sample;
- ``old_logprobs[b, p - 1 + i]`` is the behaviour logprob the engine recorded for
  response token i, ``versions[b, p - 1 + i]`` its model step, ``advantages[b, p - 1 + i]``
  the sample's advantage (the same for each of its tokens).

So the current policy's logprobs line up with no slicing::

    logits = model(input_ids=t.input_ids, attention_mask=t.attention_mask,
                   position_ids=t.position_ids).logits
    logprobs = token_logprobs(logits, t.targets)  # [B, T], aligned with old_logprobs

Outside the positions that predict response tokens, ``old_logprobs`` and ``advantages``
are 0 and ``versions`` -1; on the untrained ones inside (an environment's tokens) they
hold what was stored, which the loss mask keeps out of every loss.
A sample whose engine recorded no logprobs (or NaN ones) has ``logprobs_known`` False on
its tokens and NaN in ``old_logprobs`` there, so that no loss can take it for a recorded
value: ``losses.policy_loss`` refuses it where the loss needs the behaviour policy.

Padded (``to_padded``): one row per sample, right padding with ``pad_id``,
``attention_mask`` 0 on padding; ``padded_chunks`` pads a trainer's micro-batches each to
its own longest sequence. Packed (``to_packed``): all samples in one row
``[1, N]`` with no padding; ``position_ids`` restart at 0 at each sequence and
``cu_seqlens`` ([S + 1], int32) holds the boundaries, as varlen attention kernels take
them (transformers' flash_attention_2 finds them from ``position_ids``). A packed row
only keeps sequences apart under such an attention implementation: with plain causal
attention (eager, sdpa) its tokens would see the sequences before them.

``seq_index[b, t]`` is the sample (0 ... S - 1, in batch order) each position belongs
to; the losses use it for per-sequence sums in either layout. Samples come in the
order of the groups and of their samples, the order of
``advantages.batch_advantages``.

``versions`` is there for staleness-aware trainers: a token's staleness at train step
t is ``t - 1 - versions``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from rollstream.consumer.batches import TrainBatch
from rollstream.shared.records import Group, Sample

if TYPE_CHECKING:
    import torch

__all__ = ["TokenBatch", "padded_chunks", "samples_of", "to_packed", "to_padded", "token_logprobs"]


@dataclass(slots=True)
class TokenBatch:
    """Per-token tensors of a batch, all of the shape of ``input_ids`` ([B, T] padded,
    [1, N] packed); see the module docstring for the alignment."""

    input_ids: torch.Tensor  # int64
    attention_mask: torch.Tensor  # int64, 1 on tokens, 0 on padding
    position_ids: torch.Tensor  # int64
    targets: torch.Tensor  # int64: the token each position predicts, pad_id where none
    loss_mask: torch.Tensor  # bool: targets is a trained response token
    old_logprobs: torch.Tensor  # float32: behaviour logprob of targets, 0 off the mask
    logprobs_known: torch.Tensor  # bool: old_logprobs holds a recorded value
    versions: torch.Tensor  # int64: model step of targets, -1 off the mask
    advantages: torch.Tensor  # float32: the sample's advantage on its response positions
    seq_index: torch.Tensor  # int64: which sample (0 ... S - 1) each position belongs to
    num_sequences: int  # S, the number of samples
    max_seqlen: int  # the longest sequence
    cu_seqlens: torch.Tensor | None = None  # int32 [S + 1], packed only

    @property
    def num_tokens(self) -> int:
        """The number of trained tokens (the loss mask's count)."""
        return int(self.loss_mask.sum())


def samples_of(batch: TrainBatch | Iterable[Group]) -> list[Sample]:
    """The samples of a TrainBatch or of groups, in group and sample order."""
    groups = batch.groups if isinstance(batch, TrainBatch) else batch
    return [s for g in groups for s in g.samples]


@dataclass(slots=True)
class _Row:
    ids: npt.NDArray[np.int64]
    targets: npt.NDArray[np.int64]
    loss: npt.NDArray[np.bool_]
    old: npt.NDArray[np.float32]
    known: npt.NDArray[np.bool_]
    versions: npt.NDArray[np.int64]
    adv: npt.NDArray[np.float32]


def _row(sample: Sample, index: int, advantage: float, mask: npt.ArrayLike | None, pad_id: int) -> _Row:
    p, r = len(sample.prompt_ids), len(sample.response_ids)
    if p == 0:
        raise ValueError(f"sample {index} has no prompt token: no position predicts its first response token")
    length = p + r
    ids = np.concatenate([sample.prompt_ids, sample.response_ids]).astype(np.int64)
    targets = np.full(length, pad_id, dtype=np.int64)
    targets[:-1] = ids[1:]
    # an agent trajectory's stored mask: its environment and tool tokens are not trained
    trained = np.ones(r, dtype=np.bool_) if sample.loss_mask is None else sample.loss_mask.astype(np.bool_)
    if mask is not None:
        m = np.asarray(mask).reshape(-1)
        if len(m) != r or not np.isin(m, (0, 1)).all():
            raise ValueError(
                f"loss mask of sample {index} must be {r} values of 0 or 1 (one per response token), "
                f"got {len(m)} values"
            )
        trained &= m.astype(np.bool_)
    span = slice(p - 1, p - 1 + r)  # the positions that predict the response tokens
    loss = np.zeros(length, dtype=np.bool_)
    loss[span] = trained
    old = np.zeros(length, dtype=np.float32)
    known = np.zeros(length, dtype=np.bool_)
    if len(sample.logprobs) == r:
        finite = np.isfinite(sample.logprobs)
        old[span] = np.where(finite, sample.logprobs, np.nan)
        known[span] = finite
    else:
        old[span] = np.nan
    versions = np.full(length, -1, dtype=np.int64)
    versions[span] = sample.response_versions
    adv = np.zeros(length, dtype=np.float32)
    adv[span] = advantage
    return _Row(ids, targets, loss, old, known, versions, adv)


def _rows(
    batch: TrainBatch | Iterable[Group],
    advantages: npt.ArrayLike | None,
    loss_masks: Sequence[npt.ArrayLike | None] | None,
    pad_id: int,
) -> list[_Row]:
    samples = samples_of(batch)
    adv = np.zeros(len(samples)) if advantages is None else np.asarray(advantages, dtype=np.float64)
    if adv.shape != (len(samples),):
        raise ValueError(f"advantages must be one value per sample: {len(samples)}, got shape {adv.shape}")
    if loss_masks is not None and len(loss_masks) != len(samples):
        raise ValueError(f"loss_masks must be one per sample: {len(samples)}, got {len(loss_masks)}")
    masks = loss_masks if loss_masks is not None else [None] * len(samples)
    return [
        _row(s, i, float(a), m, pad_id) for i, (s, a, m) in enumerate(zip(samples, adv, masks, strict=True))
    ]


def to_padded(
    batch: TrainBatch | Iterable[Group],
    advantages: npt.ArrayLike | None = None,
    *,
    pad_id: int = 0,
    loss_masks: Sequence[npt.ArrayLike | None] | None = None,
    device: str | torch.device | None = None,
) -> TokenBatch:
    """One row per sample, right-padded with ``pad_id`` to the longest sequence.

    ``advantages``: one per sample in batch order (zeros if None). A sample's tokens are
    trained where its stored ``loss_mask`` is 1 (an agent trajectory's: 0 on what an
    environment or tool said); a sample without one trains every response token.
    ``loss_masks``: one per sample, None or 0/1 per response token, narrows that further
    (a token trains where both say 1).
    """
    return _padded(_rows(batch, advantages, loss_masks, pad_id), pad_id, device)


def padded_chunks(
    batch: TrainBatch | Iterable[Group],
    advantages: npt.ArrayLike | None = None,
    size: int = 0,
    *,
    pad_id: int = 0,
    loss_masks: Sequence[npt.ArrayLike | None] | None = None,
    device: str | torch.device | None = None,
) -> list[TokenBatch]:
    """``to_padded`` of the batch's samples ``size`` at a time, in batch order (0: all in
    one), each chunk padded to its own longest sequence: a trainer's micro-batches, whose
    activations are what a step's memory goes to, so a chunk of short samples is not
    padded to the batch's longest. Arguments as ``to_padded``'s (sample indexes in its
    errors are the batch's); ``seq_index`` counts from 0 in each chunk."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"size is {size!r}: samples per chunk, a whole number >= 0 (0: the whole batch)")
    rows = _rows(batch, advantages, loss_masks, pad_id)
    step = size or max(len(rows), 1)
    return [_padded(rows[start : start + step], pad_id, device) for start in range(0, len(rows), step)]


def _padded(rows: list[_Row], pad_id: int, device: str | torch.device | None) -> TokenBatch:
    import torch

    b, t = len(rows), max((len(r.ids) for r in rows), default=0)

    def stack(field: str, fill: Any, dtype: Any) -> torch.Tensor:
        out = np.full((b, t), fill, dtype=dtype)
        for i, row in enumerate(rows):
            values = getattr(row, field)
            out[i, : len(values)] = values
        return torch.from_numpy(out).to(device)

    lengths = np.array([len(r.ids) for r in rows], dtype=np.int64)
    positions = np.arange(t, dtype=np.int64)[None, :].repeat(b, 0)
    attention = positions < lengths[:, None]
    return TokenBatch(
        input_ids=stack("ids", pad_id, np.int64),
        attention_mask=torch.from_numpy(attention.astype(np.int64)).to(device),
        position_ids=torch.from_numpy(np.where(attention, positions, 0)).to(device),
        targets=stack("targets", pad_id, np.int64),
        loss_mask=stack("loss", False, np.bool_),
        old_logprobs=stack("old", 0.0, np.float32),
        logprobs_known=stack("known", False, np.bool_),
        versions=stack("versions", -1, np.int64),
        advantages=stack("adv", 0.0, np.float32),
        seq_index=torch.from_numpy(np.arange(b, dtype=np.int64)[:, None].repeat(t, 1)).to(device),
        num_sequences=b,
        max_seqlen=t,
    )


def to_packed(
    batch: TrainBatch | Iterable[Group],
    advantages: npt.ArrayLike | None = None,
    *,
    pad_id: int = 0,
    loss_masks: Sequence[npt.ArrayLike | None] | None = None,
    device: str | torch.device | None = None,
) -> TokenBatch:
    """All samples back to back in one row ``[1, N]``, no padding; ``position_ids``
    restart at each sequence and ``cu_seqlens`` marks the boundaries. Arguments as
    ``to_padded``."""
    import torch

    rows = _rows(batch, advantages, loss_masks, pad_id)
    lengths = np.array([len(r.ids) for r in rows], dtype=np.int64)

    def cat(field: str, dtype: Any) -> torch.Tensor:
        parts = [getattr(r, field) for r in rows]
        flat = np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)
        return torch.from_numpy(flat[None, :]).to(device)

    n = int(lengths.sum())
    positions = np.concatenate([np.arange(k, dtype=np.int64) for k in lengths]) if len(rows) else lengths
    return TokenBatch(
        input_ids=cat("ids", np.int64),
        attention_mask=torch.ones((1, n), dtype=torch.int64, device=device),
        position_ids=torch.from_numpy(positions[None, :]).to(device),
        targets=cat("targets", np.int64),
        loss_mask=cat("loss", np.bool_),
        old_logprobs=cat("old", np.float32),
        logprobs_known=cat("known", np.bool_),
        versions=cat("versions", np.int64),
        advantages=cat("adv", np.float32),
        seq_index=torch.from_numpy(np.repeat(np.arange(len(rows), dtype=np.int64), lengths)[None, :]).to(
            device
        ),
        num_sequences=len(rows),
        max_seqlen=int(lengths.max(initial=0)),
        cu_seqlens=torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)).to(device),
    )


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)`` at each position's target token ([..., T, V] and [..., T]
    → [..., T]), in float32 at least: the current policy's logprobs, aligned with
    ``TokenBatch.old_logprobs``. The engines record logprobs of the untempered
    distribution (temperature 1), and so does this. Float64 logits stay float64 (a test
    that compares two ways of computing one update needs its precision)."""
    import torch

    logp = torch.log_softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
