"""Token in, token out, with a Hugging Face tokenizer for which decoding and encoding again
is not the identity: a byte-level BPE built on the spot, whose merges make "guess" one
token. The scripted model samples its turns a character at a time (ids a tokenizer
would never produce from the text, as a real model may sample them); the trajectory
the agent stores holds exactly those ids, the observations as the tokenizer encodes
them once, and a trainer reading the stream gets the same ids back. Decoding the
trajectory and encoding it again gives other ids: what a loop that re-tokenises its
chat history would have trained on."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from tests.helpers import require

require("transformers", "hf")

from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers import models as tokenizer_models
from transformers import PreTrainedTokenizerFast

from rollstream.producer.agents.base import AgentConfig, Rollout
from rollstream.producer.agents.registry import load_agent
from rollstream.producer.engines.base import FINISH_STOP, Generation
from rollstream.producer.tokenizer import HFTokenizer
from rollstream.shared import codec
from rollstream.shared.records import ENV, MODEL, Group, Prompt, Sample, Status
from tests.hf_fixtures import CHAT_TEMPLATE, SPECIAL

CORPUS = ["guess the number : higher lower correct , guess 45 , guess 42 , user assistant"] * 50
CHAT = [{"role": "user", "content": "guess the number"}]
PROMPT = Prompt(uid="g1", task="guess", prompt=CHAT, meta={"answer": 42})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    core = Tokenizer(tokenizer_models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(CORPUS, trainer)
    fast: Any = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    directory = tmp_path_factory.mktemp("bpe")
    fast.save_pretrained(directory)
    return HFTokenizer(str(directory))


def by_character(tokenizer: HFTokenizer, text: str) -> list[int]:
    """The ids of ``text`` one character per token: a sampling the BPE merges never give."""
    hf = tokenizer.tokenizer
    pieces = [hf.backend_tokenizer.pre_tokenizer.pre_tokenize_str(c)[0][0] for c in text]
    return [int(hf.convert_tokens_to_ids(p)) for p in pieces]


class CharacterModel:
    """Turn t of the trajectory says ``turns[t]`` (then EOS), sampled a character at a time."""

    def __init__(self, tokenizer: HFTokenizer, turns: list[str]) -> None:
        self.tokenizer = tokenizer
        self.turns = turns
        self.sampled: list[list[int]] = []
        self.contexts: list[list[int]] = []

    async def __call__(
        self, ids: list[int], n: int, max_tokens: int, rid: str, stop: Any
    ) -> list[Generation]:
        turn = int(rid.rsplit(".", 1)[1])
        text = self.turns[turn]
        sampled = [*by_character(self.tokenizer, text), self.tokenizer.tokenizer.eos_token_id]
        self.sampled.append(sampled)
        self.contexts.append(list(ids))
        logprobs = -np.linspace(0.1, 0.9, len(sampled))
        return [Generation(sampled, logprobs, [3] * len(sampled), FINISH_STOP, text)]


def test_the_stored_ids_are_the_sampled_ones_not_a_re_tokenisation(tokenizer: HFTokenizer) -> None:
    hf = tokenizer.tokenizer
    model = CharacterModel(tokenizer, ["guess 45", "guess 42"])
    prompt_ids = tokenizer.encode(PROMPT.prompt)
    config = AgentConfig(
        max_tokens=32, max_turns=4, options={"env": "rollstream.producer.agents.examples:GuessNumber"}
    )
    agent = load_agent("multi_turn", config)
    rollout = Rollout(PROMPT, prompt_ids, tokenizer, model, "guess:g1#1-0#1")
    fresh = Sample(prompt_ids, [], [], [], status=Status.ABORTED)
    (sample,) = asyncio.run(agent.run_group(rollout, [fresh]))

    # the observation: what the chat template adds for a user message after the model's
    # turn, encoded once without special tokens added
    observation = "user : lower </s> assistant :"
    observation_ids = hf.encode(observation, add_special_tokens=False)
    first, second = model.sampled
    assert sample.response_ids.tolist() == first + observation_ids + second
    assert [(t.role, t.length) for t in sample.turns] == [
        (MODEL, len(first)),
        (ENV, len(observation_ids)),
        (MODEL, len(second)),
    ]
    assert sample.turns[1].text == observation
    assert sample.loss_mask.tolist() == [1] * len(first) + [0] * len(observation_ids) + [1] * len(second)
    assert sample.agent_status == "done" and [t.reward for t in sample.turns] == [0.0, None, 1.0]
    # the second turn was asked of the engine as ids: the first turn as sampled, then the
    # observation's ids
    assert model.contexts[1] == prompt_ids + first + observation_ids

    # a trainer reads exactly those ids back
    group = Group.for_prompt(PROMPT, samples=[sample])
    fields = codec.encode_group(group)
    raw = {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in fields.items()}
    (read,) = codec.decode_group(raw).samples
    assert read.response_ids.tolist() == sample.response_ids.tolist()
    assert read.loss_mask.tolist() == sample.loss_mask.tolist()
    assert np.array_equal(read.logprobs[: len(first)], np.float32(-np.linspace(0.1, 0.9, len(first))))

    # decoding and encoding again is not the identity here: a re-tokenising loop would
    # have trained on ids the model never sampled
    whole = prompt_ids + sample.response_ids.tolist()
    again = hf.encode(hf.decode(whole), add_special_tokens=False)
    assert hf.decode(again) == hf.decode(whole)  # the same text...
    assert again != whole  # ...in other ids
    assert hf.encode("guess 45", add_special_tokens=False) != first[:-1]  # "guess" is one token there


def test_a_chat_prompt_is_the_template_rendered_then_encoded_once(tokenizer: HFTokenizer) -> None:
    hf = tokenizer.tokenizer
    ids = tokenizer.encode(CHAT)
    assert all(type(i) is int for i in ids)
    text = "<s>user : guess the number </s> assistant :"
    assert hf.decode(ids) == text and ids == hf.encode(text, add_special_tokens=False)
    assert ids.count(hf.bos_token_id) == 1  # the template's BOS, no second one added


def test_a_chat_template_that_cannot_frame_a_turn_says_what_to_set(tokenizer: HFTokenizer) -> None:
    from rollstream.producer.agents.text import TurnText

    hf = tokenizer.tokenizer
    saved = hf.chat_template
    hf.chat_template = (
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('no role ' + m['role']) }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    try:
        text = TurnText(tokenizer, CHAT)
        with pytest.raises(
            ValueError, match=r"cannot render a 'tool' message.*set the agent option turn_template"
        ):
            text.encode("tool", "42")
        assert text.encode("user", "lower")[1] == "lower"  # the roles it knows are framed as it frames them
    finally:
        hf.chat_template = saved
