"""A batch as padded and packed tensors: alignment of targets, mask, behaviour logprobs,
versions and advantages on a hand-built batch of two samples of different lengths."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.helpers import require

torch = require("torch", "hf")

from rollstream.consumer.batches import TrainBatch
from rollstream.consumer.tensors import samples_of, to_packed, to_padded, token_logprobs
from rollstream.shared.buffer_types import Batch, BatchItem
from rollstream.shared.records import Group, Prompt, Sample

# Sample A: prompt [1, 2, 3], response [4, 5]; sample B: prompt [9], response [10, 11, 12]
A = Sample([1, 2, 3], [4, 5], [-0.1, -0.2], [7, 8], "stop", {"score": 1.0})
B = Sample([9], [10, 11, 12], [-0.3, -0.4, -0.5], [6, 6, 7], "length", {"score": 0.0})


def groups() -> list[Group]:
    return [Group.for_prompt(Prompt(uid="u", task="math", prompt="q"), samples=[A, B])]


def rows(t: torch.Tensor) -> list[list[float]]:
    return [[round(float(v), 6) for v in row] for row in t]


def test_padded_alignment() -> None:
    t = to_padded(groups(), [0.5, -0.5], pad_id=0)
    # A is 5 tokens long, B 4: B gets one pad on the right
    assert t.input_ids.tolist() == [[1, 2, 3, 4, 5], [9, 10, 11, 12, 0]]
    assert t.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert t.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 0]]
    # position t predicts token t + 1; nothing after a sequence's last token
    assert t.targets.tolist() == [[2, 3, 4, 5, 0], [10, 11, 12, 0, 0]]
    # A's response 4, 5 is predicted from positions 2 (token 3) and 3 (token 4);
    # B's response 10, 11, 12 from positions 0, 1, 2
    assert t.loss_mask.tolist() == [
        [False, False, True, True, False],
        [True, True, True, False, False],
    ]
    assert rows(t.old_logprobs) == [[0, 0, -0.1, -0.2, 0], [-0.3, -0.4, -0.5, 0, 0]]
    assert t.logprobs_known.tolist() == t.loss_mask.tolist()
    assert t.versions.tolist() == [[-1, -1, 7, 8, -1], [6, 6, 7, -1, -1]]
    assert rows(t.advantages) == [[0, 0, 0.5, 0.5, 0], [-0.5, -0.5, -0.5, 0, 0]]
    assert t.seq_index.tolist() == [[0] * 5, [1] * 5]
    assert (t.num_sequences, t.max_seqlen, t.num_tokens, t.cu_seqlens) == (2, 5, 5, None)
    assert t.input_ids.dtype == torch.int64 and t.old_logprobs.dtype == torch.float32


def test_padded_from_a_train_batch_with_a_pad_id_and_a_custom_mask() -> None:
    batch = TrainBatch(1, {"math": Batch("math", [BatchItem(None, g) for g in groups()])})  # type: ignore[arg-type]
    assert samples_of(batch) == [A, B]
    # an agent trajectory's own mask: B's second response token (11, a tool's output) untrained
    t = to_padded(batch, [1.0, 2.0], pad_id=99, loss_masks=[None, [1, 0, 1]])
    assert t.input_ids.tolist()[1] == [9, 10, 11, 12, 99]
    assert t.targets.tolist()[1] == [10, 11, 12, 99, 99]
    assert t.loss_mask.tolist() == [
        [False, False, True, True, False],
        [True, False, True, False, False],
    ]
    # the advantage stays on every response position; the mask decides what trains
    assert rows(t.advantages)[1] == [2.0, 2.0, 2.0, 0, 0]


def test_packed_alignment() -> None:
    t = to_packed(groups(), [0.5, -0.5], pad_id=0)
    assert t.input_ids.tolist() == [[1, 2, 3, 4, 5, 9, 10, 11, 12]]
    assert t.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert t.cu_seqlens is not None and t.cu_seqlens.tolist() == [0, 5, 9]
    assert t.attention_mask.tolist() == [[1] * 9]
    # A's last token (5, position 4) predicts nothing: not B's first token 9
    assert t.targets.tolist() == [[2, 3, 4, 5, 0, 10, 11, 12, 0]]
    assert t.loss_mask.tolist() == [[False, False, True, True, False, True, True, True, False]]
    assert rows(t.old_logprobs) == [[0, 0, -0.1, -0.2, 0, -0.3, -0.4, -0.5, 0]]
    assert t.versions.tolist() == [[-1, -1, 7, 8, -1, 6, 6, 7, -1]]
    assert rows(t.advantages) == [[0, 0, 0.5, 0.5, 0, -0.5, -0.5, -0.5, 0]]
    assert t.seq_index.tolist() == [[0, 0, 0, 0, 0, 1, 1, 1, 1]]
    assert (t.num_sequences, t.max_seqlen, t.num_tokens) == (2, 5, 5)


def test_missing_or_nan_behaviour_logprobs_are_marked_unknown() -> None:
    no_logprobs = Sample([1, 2], [3, 4], [], [0, 0])
    one_nan = Sample([1], [5, 6], [-0.5, float("nan")], [0, 0])
    g = Group.for_prompt(Prompt(uid="u", task="math", prompt="q"), samples=[no_logprobs, one_nan])
    t = to_padded([g])  # lengths 4 and 3
    assert t.loss_mask.tolist() == [[False, True, True, False], [True, True, False, False]]
    assert t.logprobs_known.tolist() == [[False] * 4, [True, False, False, False]]
    nan = float("nan")  # unknown behaviour logprobs are NaN, never a number a loss could use
    assert np.array_equal(t.old_logprobs.numpy(), [[0, nan, nan, 0], [-0.5, nan, 0, 0]], equal_nan=True)
    assert rows(t.advantages) == [[0] * 4, [0] * 4]  # no advantages given: zeros


def test_bad_input_is_refused_with_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="one value per sample: 2"):
        to_padded(groups(), [1.0])
    with pytest.raises(ValueError, match="one per sample: 2"):
        to_padded(groups(), [1.0, 0.0], loss_masks=[None])
    with pytest.raises(ValueError, match="loss mask of sample 1 must be 3 values of 0 or 1"):
        to_packed(groups(), [1.0, 0.0], loss_masks=[None, [1, 1]])
    with pytest.raises(ValueError, match="loss mask of sample 0 must be 2 values of 0 or 1"):
        to_padded(groups(), [1.0, 0.0], loss_masks=[[1, 2], None])
    empty_prompt = Group.for_prompt(
        Prompt(uid="u", task="t", prompt="q"), samples=[Sample([], [3], [-1], [0])]
    )
    with pytest.raises(ValueError, match="sample 0 has no prompt token"):
        to_padded([empty_prompt])


def test_token_logprobs_gathers_each_positions_target() -> None:
    # a vocabulary of 16; at each position the target's logit is log 3, the others 0:
    # p(target) = 3 / (3 + 15) = 1/6
    t = to_padded(groups(), [0.0, 0.0])
    logits = torch.zeros(*t.targets.shape, 16)
    logits.scatter_(-1, t.targets.unsqueeze(-1), math.log(3.0))
    lp = token_logprobs(logits, t.targets)
    assert lp.shape == t.targets.shape
    assert torch.allclose(lp, torch.full_like(lp, math.log(1 / 6)))
    # vocabulary of 4, logit log 3 on token 3: p(3) = 3 / 6, p(2) = 1 / 6
    logits = torch.zeros(1, 1, 4)
    logits[0, 0, 3] = math.log(3.0)
    assert float(token_logprobs(logits, torch.tensor([[2]]))) == pytest.approx(math.log(1 / 6))
    assert float(token_logprobs(logits, torch.tensor([[3]]))) == pytest.approx(math.log(3 / 6))
