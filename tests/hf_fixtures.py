"""A tiny Hugging Face model and tokenizer built on the spot: the tests of the hf engine
run without the hub (no network) and in seconds on a CPU.

The tokenizer is a word-level one trained on a few sentences; its chat template
is a small Jinja one, so encode_prompt's use of it shows in the token ids.
The model is a random-initialised Llama; ``seed`` picks its weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL = ["<s>", "</s>", "<unk>", "<pad>"]
CORPUS = [
    "the cat sat on the mat and the dog ate the bone",
    "a quick brown fox jumps over the lazy dog",
    "system user assistant : what is two plus two ? four",
    "one two three four five six seven eight nine ten",
    "red green blue yellow black white sun moon star sky",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {{ eos_token }} "
    "{% endfor %}{% if add_generation_prompt %}assistant :{% endif %}"
)


def make_tokenizer() -> Any:
    core = Tokenizer(models.WordLevel(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=SPECIAL))
    bos = core.token_to_id("<s>")
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tokenizer: Any = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_model(tokenizer: Any, seed: int, hidden: int = 32, layers: int = 2, heads: int = 2) -> Any:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,  # save_pretrained then leaves lm_head out: update_weights must cope
        initializer_range=0.2,  # peaked logits: greedy text that varies and differs between seeds
    )
    torch.manual_seed(seed)
    model: Any = LlamaForCausalLM(config)
    return model.eval()


def save_model(directory: Path, seed: int, tokenizer: Any = None, **size: int) -> Path:
    """A model directory as from_pretrained reads it: config, safetensors, tokenizer."""
    tokenizer = tokenizer or make_tokenizer()
    make_model(tokenizer, seed, **size).save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


# The size the vLLM engine tests use: head_dim 64 (hidden 128 / 2 heads); vLLM's CPU
# attention has no kernel for the head_dim 16 of the default size.
VLLM_SIZE = {"hidden": 128, "heads": 2}


def load_model(directory: Path) -> Any:
    """A saved model back, float32 on the CPU, to compute what an engine should have."""
    model: Any = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return model.eval()


def response_logprobs(model: Any, prompt_ids: list[int], response_ids: list[int]) -> Any:
    """log_softmax of each response token given the prompt and the tokens before it
    (teacher forcing): what the trainer recomputes, as a numpy array."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    rows = torch.log_softmax(logits, dim=-1)
    return rows.gather(1, torch.tensor(response_ids)[:, None])[:, 0].numpy()


def spliced_logprobs(
    old: Any, new: Any, prompt_ids: list[int], response_ids: list[int], boundary: int
) -> Any:
    """The logprobs of a response whose weights changed in place before token ``boundary``
    (a partial weight sync that kept the KV cache): the prompt and the first
    ``boundary`` tokens come from ``old``, and so does the cache they leave; the token
    before ``boundary`` is fed to ``new`` (its step samples token ``boundary``), which
    attends to the old cache from there on."""
    prompt, response = list(prompt_ids), list(response_ids)
    with torch.no_grad():
        first = old(input_ids=torch.tensor([prompt + response[: boundary - 1]]), use_cache=True)
        head = torch.log_softmax(first.logits[0, len(prompt) - 1 :].float(), dim=-1)
        rest = new(
            input_ids=torch.tensor([response[boundary - 1 : -1]]),
            past_key_values=first.past_key_values,
            use_cache=True,
        )
        tail = torch.log_softmax(rest.logits[0].float(), dim=-1)
    rows = torch.cat([head, tail])
    return rows.gather(1, torch.tensor(response)[:, None])[:, 0].numpy()


def greedy_ids(model: Any, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding with transformers, EOS ignored."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_tokens):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]
