"""Recipes: runs of the whole pipeline that the demo, the benchmarks and the tests share.

- ``reverse``: the reverse task (a model generated on the spot, its tokenizer, prompts
  and judge) and the plain training loop without rollstream to compare with;
- ``learning``: the ways of training it through rollstream (``RECIPES``: sync, async,
  with or without a correction) and ``run_learning``, one run;
- ``prompts``: the small arithmetic prompt file of the simulated demo and benchmarks.

A recipe composes both sides (producer and consumer); the command line (cli/) and the
benchmarks (bench/) import recipes, recipes import neither.
"""
