"""Trainer-side adapters: rollstream behind the extension point of a trainer people
already use, keeping rollstream's guarantees (nothing lost, nothing trained again after
a commit, staleness bounded, the weights back to the engines after every optimizer step).

    trl.py        TRL's GRPOTrainer: a ``rollout_func``, a pass-through reward function
                  and a callback that commits and publishes after each optimizer step
    trl_async.py  TRL's AsyncGRPOTrainer: its rollout-worker and weight-transfer protocols
    loop.py       any PyTorch loop: an iterable of batches with ``commit()`` and
                  ``publish_weights(model)``

Each takes its parts (a coordinator or a reader, the run's control, a weight publisher, a
plan of plain numbers); consumer/assembly.py builds them from the settings
(``create_trl_rollout``, ``create_async_grpo``, ``create_batch_stream``). docs/integrations.md
is the guide. Nothing here imports the outside trainer until it is used: rollstream
imports without it.
"""
