"""PolicyGradient.save: a directory from_pretrained and the hf engine read, with the
weights of the step (tied weights stored once), written without save_pretrained."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import torch

from rollstream.consumer.pg import PolicyGradient
from rollstream.producer.engines.hf import HFEngine
from rollstream.recipes import reverse
from rollstream.shared.engine_settings import HFEngineSettings


def test_saved_steps_load_as_the_trained_weights(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = reverse.save_model(tmp_path / "model", seed=0)
    pg = PolicyGradient(str(model_dir), str(tmp_path / "out"))
    with torch.no_grad():
        for p in pg.model.parameters():
            p.add_(0.5)  # as a step would change them
    paths = [Path(pg.save(step)) for step in (1, 2)]
    assert [p.name for p in paths] == ["step-1", "step-2"]
    assert sorted(f.name for f in paths[1].iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors",
    ]  # fmt: skip
    assert json.loads((paths[1] / "config.json").read_text())["n_embd"] == 32
    loaded = AutoModelForCausalLM.from_pretrained(paths[1])
    trained = pg.model.state_dict()
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, trained[name]), name
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # still tied

    async def engine_weights() -> dict[str, torch.Tensor]:
        engine = HFEngine(HFEngineSettings(model=str(model_dir)))
        await engine.update_weights(2, str(paths[1]))
        return {k: v.clone() for k, v in engine.model.state_dict().items()}

    for name, value in asyncio.run(engine_weights()).items():
        assert torch.equal(value, trained[name]), name
