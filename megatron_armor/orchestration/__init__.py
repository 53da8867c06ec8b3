"""The driver of a run on Ray, in three rooms, plus the two-stage pipeline.

- ``run/``: a run's lifecycle (session, run directory and lock, run state, checkpoints, resume).
- ``step/``: the step (the loop, anchor and asynchronous rollout, acceptance, step metrics).
- ``actors/``: the processes and their plumbing (actor handles, workers, placement, Ray nodes,
  weight sync, recovery, faults).
- ``pipeline.py``: ``armor pipeline``, stage 1 -> export its best checkpoint -> stage 2.
"""
