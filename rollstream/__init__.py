"""rollstream: a rollout pipeline for LLM reinforcement learning on Redis Streams.

Everything is imported from this one package, so nothing lands in site-packages under a
name another distribution could hold:

    from rollstream.consumer import BatchReader, publish_weights   # a trainer
    from rollstream.producer.engines import Engine                  # an engine plug-in
    from rollstream.shared.settings import load_settings

In a checkout the parts live at the root (producer/, consumer/, shared/, cli/) and
pyproject.toml's package-dir maps each into this package: shared/buffer.py is
rollstream.shared.buffer, in a wheel as in an editable install.
"""

__version__ = "0.1.0"
