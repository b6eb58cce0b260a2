"""The reverse task (rollstream.recipes.reverse) and its judge: rewards computed by hand, the
tokenizer's round trip, the generated model as the hf engine loads it, the prompt files,
and that the same model learns the task in a plain loop (no Redis)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from rollstream.producer.engines.base import FINISH_LENGTH, FINISH_STOP, SamplingParams
from rollstream.producer.engines.hf import HFEngine
from rollstream.producer.judges import load_judge
from rollstream.producer.judges.base import JudgeError
from rollstream.producer.judges.reverse import ReverseJudge, partial_reward
from rollstream.producer.prompts import read_prompt_file
from rollstream.recipes import reverse
from rollstream.shared.engine_settings import HFEngineSettings
from rollstream.shared.records import Prompt, Sample


def prompt(answer: str = "m a c", **meta: Any) -> Prompt:
    return Prompt(uid="cam", task="reverse", prompt="c a m >", meta={"answer": answer, **meta})


def sample(text: str, finish: str = FINISH_STOP) -> Sample:
    return Sample([3, 4, 5, 2], [], [], [], finish_reason=finish, text=text)


@pytest.mark.parametrize(
    ("text", "finish", "score"),
    [
        ("m a c", FINISH_STOP, 1.0),  # 3 symbols and the end: 4 of 4
        ("m a c", FINISH_LENGTH, 0.75),  # no end-of-sequence
        ("m a c c", FINISH_LENGTH, 0.75),  # one symbol too many: the end is missing
        ("m c a", FINISH_STOP, 0.5),  # first symbol and the end
        ("m a", FINISH_STOP, 0.5),  # two symbols, then an end one position early
        ("a c m", FINISH_STOP, 0.25),  # reversed the wrong way: only the end
        ("", FINISH_STOP, 0.0),  # ended at once
        ("x y z", FINISH_LENGTH, 0.0),
        ("ma  c", FINISH_STOP, 1.0),  # spacing does not count (texts of a continued rollout)
    ],
)
def test_partial_reward_per_position(text: str, finish: str, score: float) -> None:
    (reward,) = ReverseJudge()(prompt(), [sample(text, finish)])
    assert reward == {"score": score, "exact": 1.0 if score == 1.0 else 0.0}


def test_exact_scoring_for_greedy_accuracy_and_bad_meta() -> None:
    judge = ReverseJudge()
    rewards = judge(prompt(scoring="exact"), [sample("m a c"), sample("m a c", FINISH_LENGTH)])
    assert [r["score"] for r in rewards] == [1.0, 0.0]
    with pytest.raises(JudgeError, match=r"meta\['scoring'\] is 'best'; allowed: partial, exact"):
        judge(prompt(scoring="best"), [sample("m a c")])
    with pytest.raises(JudgeError, match=r"has no meta\['answer'\]"):
        judge(Prompt(uid="u", task="reverse", prompt="a b c >"), [sample("c b a")])
    assert partial_reward(list("ab"), list("ab"), stopped=True) == 1.0
    assert isinstance(load_judge("reverse"), ReverseJudge)


def test_tokenizer_round_trip_and_vocabulary(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = reverse.make_tokenizer()
    assert len(tokenizer) == len(reverse.VOCAB) == 16
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1)
    ids = tokenizer.encode("c a m >")
    assert ids == [5, 3, 15, 2]
    assert tokenizer.decode(ids) == "c a m >"
    assert tokenizer.decode([*ids[:3], 1], skip_special_tokens=True) == "c a m"  # <eos> is left out
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)  # as producers and engines load it
    assert loaded.encode("m a c >") == [15, 3, 5, 2] and loaded.eos_token_id == 1
    with pytest.raises(Exception, match="UNK"):  # no symbol outside the vocabulary
        tokenizer.encode("c a z >")


def test_the_hf_engine_loads_the_generated_model(tmp_path: Path) -> None:
    model = reverse.make_model(seed=3)
    assert reverse.parameter_count(model) == 13_792  # ~14k: hidden 32, one layer, four heads
    reverse.save_model(tmp_path, seed=3)
    engine = HFEngine(HFEngineSettings(model=str(tmp_path)))
    ids = engine.encode_prompt("c a m >")
    params = SamplingParams(max_tokens=reverse.MAX_TOKENS, temperature=1.0, seed=1)
    generations = asyncio.run(engine.generate(ids, params, n=4))
    assert len(generations) == 4
    for generation in generations:
        assert 1 <= len(generation.response_ids) <= reverse.MAX_TOKENS
        assert generation.finish_reason in (FINISH_STOP, FINISH_LENGTH)
        assert (generation.finish_reason == FINISH_STOP) == (int(generation.response_ids[-1]) == 1)
        # the recorded logprobs are the model's own (what the trainer recomputes)
        with torch.no_grad():
            full = torch.tensor([ids + generation.response_ids.tolist()])
            logits = model(input_ids=full).logits[0, len(ids) - 1 : -1]
        chosen = torch.tensor(generation.response_ids)[:, None].long()
        expected = torch.log_softmax(logits, -1).gather(1, chosen)[:, 0]
        assert generation.logprobs == pytest.approx(expected.numpy(), abs=1e-5)


def test_prompts_cover_the_task_with_a_held_out_split(tmp_path: Path) -> None:
    train, held_out = reverse.all_prompts(seed=0)
    assert (len(train), len(held_out)) == (13**3 - reverse.EVAL_PROMPTS, reverse.EVAL_PROMPTS)
    assert not {p.uid for p in train} & {p.uid for p in held_out}
    assert reverse.all_prompts(seed=0) == (train, held_out)  # the seed decides
    assert reverse.all_prompts(seed=1)[1] != held_out
    for p in train[:50]:
        a, b, c, arrow = str(p.prompt).split()
        assert arrow == ">" and p.meta["answer"] == f"{c} {b} {a}"
    train_path, eval_path = reverse.write_prompt_files(tmp_path, seed=0)
    assert [p.uid for p in read_prompt_file(eval_path, "reverse")] == [p.uid for p in held_out]
    assert len(read_prompt_file(train_path, "reverse")) == len(train)


@pytest.mark.heavy  # a learning smoke (100 steps of training): make test-all and CI
def test_the_model_learns_the_task_in_a_plain_loop(tmp_path: Path) -> None:
    """The unit-speed check of model, task and algorithm: GRPO 8 prompts x 8 samples,
    Adam 1e-3, one update a batch. Measured (seeds 0-5): chance 0.07-0.09 over the first
    20 steps, 0.28-0.30 over steps 81-100 (0.9 takes 300-400 steps); asserted: 0.2."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reverse.save_model(tmp_path / "model", seed=0)
        run = reverse.train_in_process(tmp_path / "model", 100, seed=0)
    finally:
        torch.set_num_threads(threads)
    first, last = run.rewards[:20], run.rewards[-20:]
    assert sum(first) / 20 < 0.12  # chance: 1/16 a position
    assert sum(last) / 20 > 0.2
