"""Weight transports end to end with the hf engine: a trainer changes some of its tensors
in place (an optimizer step), sends them through the transport (only what changed, a
full set every third send), and an engine host moves to the step in each sync mode
while a request runs; after every sync the engine's weights equal the trainer's, also
for an engine restarted between two syncs (it reads the whole set)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import require

torch = require("torch", "hf")
require("transformers", "hf")

from rollstream.producer.engines.base import FINISH_ABORT, FINISH_LENGTH, SamplingParams
from rollstream.producer.engines.hf import HFEngine
from rollstream.producer.fleet.host import EngineHost
from rollstream.shared.engine_settings import HFEngineSettings
from rollstream.shared.transports import (
    TransportSettings,
    read_safetensors,
    receive,
    sender_for,
    unique_tensors,
)
from tests.helpers import wait_for_async
from tests.hf_fixtures import load_model, save_model

SYNCS = 5
RESTART_BEFORE = 3  # the engine is replaced by a fresh one before this sync


def train_step(model: Any, step: int) -> None:
    """Half the tensors change, a different half each step (the embeddings every step)."""
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if i % 2 == step % 2 or "embed" in name:
                p.add_(torch.randn_like(p) * 0.05)


def assert_same_weights(engine: HFEngine, trainer: Any) -> None:
    mine, theirs = engine.model.state_dict(), trainer.state_dict()
    assert mine.keys() == theirs.keys()
    different = [k for k in mine if not torch.equal(mine[k], theirs[k])]
    assert not different, different


@pytest.mark.parametrize("mode", ["drain", "abort", "partial"])
@pytest.mark.parametrize("kind", ["file", "ray", "collective", "shm", "auto"])
def test_engine_weights_equal_the_trainers_after_every_sync(
    kind: str, mode: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if kind == "ray":
        request.getfixturevalue("ray_local")
    directory = save_model(tmp_path / "model", seed=1)
    trainer = load_model(directory)
    settings = TransportSettings(kind=kind, changed_only=True, full_every=3, keep=2, shards=3, bucket_mb=1)  # type: ignore[arg-type]
    sender = sender_for(settings, str(tmp_path / "weights"), run=f"transports-{mode}")

    def start() -> tuple[HFEngine, EngineHost, list[int]]:
        engine = HFEngine(HFEngineSettings(model=str(directory)))
        steps = [0]
        step = engine._step

        def counted(*args: Any) -> Any:
            steps[0] += 1
            return step(*args)

        engine._step = counted  # type: ignore[method-assign]
        return engine, EngineHost(engine), steps

    async def scenario() -> None:
        engine, host, steps = start()
        prompt = engine.encode_prompt("the cat sat on the mat")
        for model_step in range(1, SYNCS + 1):
            train_step(trainer, model_step)
            uri = sender.send(model_step, unique_tensors(trainer.state_dict()))
            if model_step == RESTART_BEFORE:
                engine.stop()
                engine, host, steps = start()
                await host.sync_weights(model_step - 1, None, mode)  # as a rejoining engine: the run's step
            tokens = 40 if mode == "drain" else 100_000
            params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
            running = asyncio.create_task(host.generate(prompt, params, 2, f"r{model_step}"))
            seen = steps[0]
            await wait_for_async(lambda s=steps, n=seen: s[0] >= n + 2, timeout=60, interval=0.001)
            if mode == "partial":
                await host.sync_weights(model_step, uri, mode)
                # a step that starts after the sync returned runs on the new weights; the
                # one after it has started once that step's token is in
                synced = steps[0]
                await wait_for_async(lambda s=steps, n=synced: s[0] >= n + 2, timeout=60, interval=0.001)
                await host.abort([f"r{model_step}"])
            else:
                await host.sync_weights(model_step, uri, mode)
            gens = await asyncio.wait_for(running, 60)
            assert_same_weights(engine, trainer)
            assert host.model_step == model_step and engine.model_step == model_step
            versions = gens[0].versions.tolist()
            if mode == "drain":  # finished on the old weights before they moved
                assert gens[0].finish_reason == FINISH_LENGTH and set(versions) == {model_step - 1}
            elif mode == "abort":
                assert gens[0].finish_reason == FINISH_ABORT and set(versions) == {model_step - 1}
            else:  # in place: later tokens from the new weights
                assert versions[0] == model_step - 1 and versions[-1] == model_step
        engine.stop()

    try:
        asyncio.run(scenario())
    finally:
        sender.close()


def test_a_step_sends_only_the_changed_tensors(tmp_path: Path) -> None:
    """The second send's directory holds only what the step changed; its index still maps
    the whole model, and an engine that loaded the first step copies only the rest."""
    directory = save_model(tmp_path / "model", seed=1)
    trainer = load_model(directory)
    sender = sender_for(TransportSettings(changed_only=True, full_every=0), str(tmp_path / "w"))
    first = sender.send(1, unique_tensors(trainer.state_dict()))
    with torch.no_grad():
        trainer.model.norm.weight.add_(1.0)
    second = sender.send(2, unique_tensors(trainer.state_dict()))
    written = [n for f in sorted(Path(second).glob("*.safetensors")) for n, _ in read_safetensors(f)]
    assert written == ["model.norm.weight"]
    sources: dict[str, str] = {}
    assert len(dict(receive(first, sources))) == len(unique_tensors(trainer.state_dict()))
    assert list(dict(receive(second, sources))) == ["model.norm.weight"]
    engine = HFEngine(HFEngineSettings(model=str(directory)))
    asyncio.run(engine.update_weights(2, second))
    assert_same_weights(engine, trainer)
    engine.stop()
    sender.close()


def test_a_step_sent_again_is_a_full_set(tmp_path: Path) -> None:
    """A trainer that redoes a step sends it again: its directory is written anew, so the
    tensors the index had there must be in the new one too, not only what changed since."""
    directory = save_model(tmp_path / "model", seed=1)
    trainer = load_model(directory)
    sender = sender_for(TransportSettings(changed_only=True, full_every=0), str(tmp_path / "w"))
    sender.send(1, unique_tensors(trainer.state_dict()))
    train_step(trainer, 2)
    sender.send(2, unique_tensors(trainer.state_dict()))
    with torch.no_grad():
        trainer.model.norm.weight.add_(1.0)
    again = sender.send(2, unique_tensors(trainer.state_dict()))
    engine = HFEngine(HFEngineSettings(model=str(directory)))
    asyncio.run(engine.update_weights(2, again))
    assert_same_weights(engine, trainer)
    engine.stop()
    sender.close()


@pytest.mark.parametrize("kind", ["file", "collective", "shm"])
def test_weights_sent_in_the_engines_dtype(kind: str, tmp_path: Path) -> None:
    """weights.dtype = bfloat16: a float32 trainer sends half the bytes, and a bfloat16
    engine holds exactly the trainer's weights rounded to bfloat16."""
    directory = save_model(tmp_path / "model", seed=1)
    trainer = load_model(directory)
    settings = TransportSettings(kind=kind, dtype="bfloat16")  # type: ignore[arg-type]
    sender = sender_for(settings, str(tmp_path / "w"))
    engine = HFEngine(HFEngineSettings(model=str(directory), dtype="bfloat16"))
    try:
        train_step(trainer, 1)
        uri = sender.send(1, unique_tensors(trainer.state_dict()))
        if kind in ("file", "shm"):
            sent = dict(receive(uri))
            assert {t.dtype for t in sent.values()} == {torch.bfloat16}
        asyncio.run(engine.update_weights(1, uri))
        theirs = trainer.state_dict()
        for name, mine in engine.model.state_dict().items():
            assert torch.equal(mine, theirs[name].to(torch.bfloat16)), name
    finally:
        engine.stop()
        sender.close()


def test_a_half_written_shm_slot_is_never_loaded(tmp_path: Path) -> None:
    """A trainer stopped between the fence's two writes (killed mid-copy): the engine's
    sync of that slot fails naming the URI, and the engine keeps the weights it had, equal
    to the trainer's last whole step; the next whole step loads."""
    from rollstream.producer.engines.base import EngineError
    from rollstream.shared.transport_shm import ShmSender

    directory = save_model(tmp_path / "model", seed=1)
    trainer = load_model(directory)
    sender = sender_for(TransportSettings(kind="shm", changed_only=True), str(tmp_path), run="torn")
    assert isinstance(sender, ShmSender)
    engine = HFEngine(HFEngineSettings(model=str(directory)))
    try:
        train_step(trainer, 1)
        first = sender.send(1, unique_tensors(trainer.state_dict()))
        train_step(trainer, 2)
        asyncio.run(engine.update_weights(2, sender.send(2, unique_tensors(trainer.state_dict()))))
        slot = next(s for s in sender.slots if str(s.path) in first)
        slot.begin()  # step 3 starts into step 1's slot and never ends
        with pytest.raises(EngineError, match="being written"):
            asyncio.run(engine.update_weights(3, first))
        assert engine.model_step == 2
        assert_same_weights(engine, trainer)
        train_step(trainer, 3)
        asyncio.run(engine.update_weights(3, sender.send(3, unique_tensors(trainer.state_dict()))))
        assert_same_weights(engine, trainer)
    finally:
        engine.stop()
        sender.close()


def test_shm_syncs_reuse_the_engines_buffers_and_convert_into_its_dtype(tmp_path: Path) -> None:
    """A bfloat16 engine of a float32 trainer over shm: each tensor is copied out of the
    shared memory into a buffer of the engine's kept from sync to sync (converted on the
    way), and the engine's weights are the trainer's rounded to bfloat16 after each sync."""
    directory = save_model(tmp_path / "model", seed=1)
    trainer = load_model(directory)
    sender = sender_for(TransportSettings(kind="shm"), str(tmp_path), run="staging")
    engine = HFEngine(HFEngineSettings(model=str(directory), dtype="bfloat16"))
    try:
        addresses = []
        for step in (1, 2, 3):
            train_step(trainer, step)
            asyncio.run(engine.update_weights(step, sender.send(step, unique_tensors(trainer.state_dict()))))
            theirs = trainer.state_dict()
            for name, mine in engine.model.state_dict().items():
                assert torch.equal(mine, theirs[name].to(torch.bfloat16)), name
            assert {t.dtype for t in engine._staging.values()} == {torch.bfloat16}
            addresses.append({n: t.data_ptr() for n, t in engine._staging.items()})
        assert addresses[0] and addresses[0] == addresses[1] == addresses[2]
        assert not engine._staging_busy
    finally:
        engine.stop()
        sender.close()
