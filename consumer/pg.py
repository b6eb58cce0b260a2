"""A real policy-optimisation step for the reference trainer (needs the hf extra).

One optimizer step per batch with the algorithm an ``AlgorithmConfig`` selects
(``consumer.losses``): group advantages (``consumer.advantages``), the batch as padded
tensors with the behaviour logprobs the engines recorded (``consumer.tensors``), and
the policy loss: plain policy gradient by default, PPO-clip against the behaviour
logprobs, or AReaL's decoupled PPO (the proximal logprobs recomputed with the weights
of just before the update), with an optional truncated or masked importance
correction for stale samples. ``algorithm.micro_batch_size`` runs the batch through the
model that many samples at a time (gradient accumulation, the same update), which bounds
a real model's step in memory. After the step the weights go to a safetensors
directory that the hf engines load when the trainer publishes the new model step with
its path.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any

import numpy as np

from rollstream.consumer.advantages import batch_advantages
from rollstream.consumer.batches import TrainBatch
from rollstream.consumer.lora import adapter_tensors, apply_lora
from rollstream.consumer.losses import (
    AlgorithmConfig,
    LossSums,
    aggregation_count,
    divisor,
    policy_loss_part,
)
from rollstream.consumer.tensors import TokenBatch, padded_chunks, token_logprobs
from rollstream.shared import models
from rollstream.shared.records import Group
from rollstream.shared.transports import Sender, TransportSettings, sender_for, unique_tensors

log = logging.getLogger(__name__)


class PolicyGradient:
    def __init__(
        self,
        model_dir: str,
        out_dir: str,
        lr: float = 1e-5,
        device: str = "cpu",
        algorithm: AlgorithmConfig | None = None,
        weights: TransportSettings | None = None,
        run: str = "",
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch: Any = torch
        self.device = torch.device(device)
        # a known model by name (smollm2-135m): its cached conversion
        model: Any = AutoModelForCausalLM.from_pretrained(models.resolve(model_dir), dtype=torch.float32)
        self.algorithm = algorithm if algorithm is not None else AlgorithmConfig()
        a = self.algorithm
        self.lora = a.lora_rank > 0  # an adapter trains (consumer/lora.py) and is all a sync sends
        if self.lora:
            model = apply_lora(model, a.lora_rank, a.lora_alpha, a.lora_targets)
        self.model: Any = model.to(self.device).train()
        # whether the model's forward can leave the prompt's logits out (logprobs)
        base = model.get_base_model() if self.lora else model
        self._keeps_logits = "logits_to_keep" in inspect.signature(base.forward).parameters
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=lr)
        self.out_dir = Path(out_dir)
        pad = getattr(self.model.config, "pad_token_id", None)
        self.pad_id = int(pad) if isinstance(pad, int) else 0  # any id: padding is masked out
        self.metrics: dict[str, float] = {}  # the last step's (consumer.losses.policy_loss)
        self._config_files: dict[str, str] = {}  # what save writes beside the weights
        # weights.* (shared/transports.py): how save sends; None: one safetensors file a step
        self.weights = weights
        self.run = run
        self._sender: Sender | None = None

    def __call__(self, batch: TrainBatch) -> float:
        """One optimizer step on the batch; returns the loss (0.0, and no step, when no
        group carries a signal: every advantage zero).

        The batch goes through the model ``algorithm.micro_batch_size`` samples at a time
        (0: all at once), each micro-batch padded to its own longest sequence and its
        activations freed by its own backward pass: a step holds one micro-batch's. The
        update is still the whole batch's: each micro-batch backpropagates its share of
        the loss, its numerator over the whole batch's divisor
        (``consumer.losses.policy_loss_part``), and the metrics are the whole batch's too.
        No optimizer step comes between the micro-batches, so each one's forward pass runs
        with the weights of just before the update: decoupled PPO's proximal policy for
        all of them, no second pass needed."""
        cfg = self.algorithm
        groups = batch.groups
        advantages = batch_advantages(groups, cfg.advantage, eps=cfg.adv_eps, std=cfg.adv_std)
        if not advantages.any():
            self.metrics = {"loss": 0.0, "tokens": 0.0}
            return 0.0
        if cfg.needs_behaviour_logprobs:
            _require_logprobs(groups, cfg)
        size = cfg.micro_batch_size
        chunks = padded_chunks(groups, advantages, size, pad_id=self.pad_id, device=self.device)
        self.optimizer.zero_grad()
        total = self._accumulate(chunks)
        self.optimizer.step()
        self.metrics = total.metrics(cfg)
        log.debug("train step %d: %s", batch.train_step, self.metrics)
        return self.metrics["loss"]

    def _accumulate(self, chunks: list[TokenBatch]) -> LossSums:
        """The whole batch's gradient from its micro-batches, and its loss's sums.

        Each micro-batch's numerator is divided by the divisor the loss masks give, known
        before any forward pass, and the gradient is rescaled afterwards where the true
        one differed: masked IS drops sequences out of it by the ratios the passes
        compute. With one micro-batch its own count is the true one, so the whole batch
        in one pass computes exactly what ``policy_loss`` would."""
        torch = self.torch
        cfg = self.algorithm
        # where a sample has none, pg without a correction trains without the behaviour
        # logprobs and reports no ratio: for the whole batch, as one pass over it would
        recorded = cfg.needs_behaviour_logprobs or all(
            bool(t.logprobs_known[t.loss_mask].all()) for t in chunks
        )
        count = sum(aggregation_count(t.loss_mask, cfg.agg) for t in chunks)
        total = LossSums()
        for tokens in chunks:
            logprobs = self.logprobs(tokens)
            numerator, sums = policy_loss_part(
                logprobs,
                tokens.old_logprobs if recorded else None,  # NaN where none: refused where needed
                tokens.advantages,
                tokens.loss_mask,
                cfg,
                proximal_logprobs=logprobs.detach() if cfg.needs_proximal_logprobs else None,
            )
            count = sums.count if len(chunks) == 1 else count
            torch.autograd.backward(numerator / divisor(cfg.agg, count, cfg.agg_norm))
            total.add(sums)
        if total.count != count:
            scale = divisor(cfg.agg, count, cfg.agg_norm) / divisor(cfg.agg, total.count, cfg.agg_norm)
            for parameter in self.trainable:
                if parameter.grad is not None:
                    parameter.grad.mul_(scale)
        return total

    def logprobs(self, tokens: TokenBatch) -> Any:
        """The model's logprob of each position's target token, aligned with
        ``tokens.old_logprobs`` (0 before the first position any loss reads).

        The output projection runs only from the first position that predicts a trained
        token on (transformers' ``logits_to_keep``, where the model takes it): a prompt's
        positions predict nothing that is trained, and their logits over the whole
        vocabulary were most of the step's memory for a real model (SmolLM2-135M: 49,152
        entries a position, 45 prompt tokens against 24 of response)."""
        torch = self.torch
        trained = tokens.loss_mask.any(dim=0).nonzero()
        first = int(trained[0]) if len(trained) and self._keeps_logits else 0
        kwargs = {"logits_to_keep": torch.arange(first, tokens.input_ids.shape[1])} if first else {}
        logits = self.model(
            input_ids=tokens.input_ids,
            attention_mask=tokens.attention_mask,
            position_ids=tokens.position_ids,
            **kwargs,
        ).logits
        kept = token_logprobs(logits, tokens.targets[:, first:])
        if not first:
            return kept
        return torch.nn.functional.pad(kept, (first, 0))

    def save(self, step: int) -> str:
        """The weights of ``step`` as a directory that ``from_pretrained`` and the engines
        read (the model's config files and one safetensors file, tied weights stored
        once); returns its path.

        Written directly rather than by ``save_pretrained``, which took ~40 ms a step even
        for a 14k-parameter model (this takes ~5 ms): a trainer that syncs the weights of
        a small model every step spent most of its step there. The config files are
        rendered once; they do not change during training."""
        from safetensors.torch import save_file, save_model

        if not self._config_files:
            self._config_files["config.json"] = self.model.config.to_json_string()
            generation = getattr(self.model, "generation_config", None)
            if generation is not None:
                self._config_files["generation_config.json"] = generation.to_json_string()
        if self.weights is not None:  # a weight transport: its URI
            if self._sender is None:
                self._sender = sender_for(self.weights, str(self.out_dir), self.run, self._config_files)
            return self._sender.send(step, self.tensors())
        path = self.out_dir / f"step-{step}"
        path.mkdir(parents=True, exist_ok=True)
        for name, text in self._config_files.items():
            (path / name).write_text(text)
        if self.lora:  # the adapter's tensors: engines merge them into the model they loaded
            save_file(self.tensors(), str(path / "model.safetensors"), metadata={"format": "pt"})
        else:
            save_model(self.model, str(path / "model.safetensors"), metadata={"format": "pt"})
        return str(path)

    def save_pretrained(self, directory: str | Path, tokenizer_from: str) -> Path:
        """The trained policy as a Hugging Face directory (``save_pretrained``: config,
        safetensors, and the tokenizer of ``tokenizer_from``, a directory or a known
        model's name), which anyone loads without rollstream or peft: a LoRA adapter is
        merged into a copy of the model, the policy trains on unchanged."""
        import copy

        from transformers import AutoTokenizer

        model = copy.deepcopy(self.model).merge_and_unload() if self.lora else self.model
        path = Path(directory)
        model.save_pretrained(path, safe_serialization=True)
        AutoTokenizer.from_pretrained(models.resolve(tokenizer_from)).save_pretrained(path)
        return path

    def tensors(self) -> dict[str, Any]:
        """What a weight sync sends: the adapter's tensors with LoRA, else every weight
        (tied ones once)."""
        return adapter_tensors(self.model) if self.lora else unique_tensors(self.model.state_dict())


def _require_logprobs(groups: list[Group], cfg: AlgorithmConfig) -> None:
    """A loss that corrects for the behaviour policy cannot guess it: name a group whose
    engine recorded no (or NaN) logprobs."""
    for group in groups:
        for i, sample in enumerate(group.samples):
            r = len(sample.response_ids)
            if r and (len(sample.logprobs) != r or not np.isfinite(sample.logprobs).all()):
                raise ValueError(
                    f"loss {cfg.loss!r} with importance {cfg.importance!r} needs the behaviour "
                    f"logprobs recorded per token, and sample {i} of group {group.group_id} has "
                    f"{len(sample.logprobs)} for {r} tokens (or NaN ones): use an engine that "
                    "records them, or loss 'pg' with importance 'none'"
                )
