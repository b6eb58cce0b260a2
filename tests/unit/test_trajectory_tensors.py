"""A trainer's tensors use an agent trajectory's stored loss mask: a multi-turn sample,
encoded and decoded as a trainer reads it, trains on its model turns only, padded and
packed; a mask the caller passes narrows it further."""

from __future__ import annotations

from tests.helpers import require

require("torch", "hf")

from rollstream.consumer.tensors import to_packed, to_padded
from rollstream.shared import codec
from rollstream.shared.records import ENV, MODEL, Group, Prompt, Sample, Turn

# prompt [1, 2]; model turn [3, 4], environment turn [50, 51], model turn [5]
TRAJECTORY = Sample(
    [1, 2],
    [3, 4, 50, 51, 5],
    [-0.1, -0.2, 0.0, 0.0, -0.3],
    [0, 0, 0, 0, 1],
    "stop",
    {"score": 1.0},
    loss_mask=[1, 1, 0, 0, 1],
    turns=[Turn(MODEL, 2, "a"), Turn(ENV, 2, "b"), Turn(MODEL, 1, "c")],
    agent_status="done",
)
PLAIN = Sample([7], [8, 9], [-0.5, -0.6], [1, 1], "stop", {"score": 0.0})


def read_back() -> list[Group]:
    group = Group.for_prompt(Prompt(uid="u", task="t", prompt="q"), samples=[TRAJECTORY, PLAIN])
    fields = codec.encode_group(group)
    raw = {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in fields.items()}
    return [codec.decode_group(raw)]


def test_padded_tensors_train_on_the_model_turns_only() -> None:
    t = to_padded(read_back(), [1.0, -1.0])
    assert t.input_ids.tolist()[0] == [1, 2, 3, 4, 50, 51, 5]
    # position p - 1 + i predicts response token i: 3, 4 trained, 50, 51 not, 5 trained
    assert t.loss_mask.tolist()[0] == [False, True, True, False, False, True, False]
    assert t.loss_mask.tolist()[1] == [True, True, False, False, False, False, False]  # no stored mask
    assert t.num_tokens == 3 + 2


def test_packed_tensors_use_the_stored_mask_and_a_given_one_narrows_it() -> None:
    t = to_packed(read_back(), [1.0, -1.0])
    assert t.loss_mask.tolist() == [[False, True, True, False, False, True, False, True, True, False]]
    narrowed = to_packed(read_back(), [1.0, -1.0], loss_masks=[[0, 1, 1, 1, 1], None])
    # the given mask cannot train what the stored one leaves out (the environment's tokens)
    assert narrowed.loss_mask.tolist() == [[False, False, True, False, False, True, False, True, True, False]]
