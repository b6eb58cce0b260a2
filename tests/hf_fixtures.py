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
