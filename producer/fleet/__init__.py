"""The run's engine fleet: the pools the producer sends its groups through (``pool.py``:
in-process engines, or the run's named Ray actors), the Ray engine actors (``actors.py``)
and the host that keeps one engine and its weights (``host.py``), the run's engine
counts in its state hash (``scaling.py``) and the scaling policy that the engines
process follows (``autoscale.py``). The engines themselves are plug-ins:
producer/engines/."""
