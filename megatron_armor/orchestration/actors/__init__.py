"""The processes of a run and their plumbing: the Ray actors and how the driver reaches them.

- ``actor_handles``: the driver's handles on the trainer ranks and the scoring workers.
- ``rollout_fleet``: the rollout workers (who, in which role, every call to them), their memory
  and their servers' health; ``rollout_draws``: the policy's and the reference's samples.
- ``rollout_worker``: the rollout worker's Ray actor; ``rollout_services``: what it serves, one
  class per concern. ``workers``: the trainer and reward workers, what every worker shares.
- ``call_kinds``, ``call_watch``, ``pending``, ``watched``: every wait bounded by the deadline
  of the kind its caller names, a stuck actor or server named and killed (``process_trees``).
- ``placement``: Ray start-up and actor placement for the three layouts.
- ``ray_node``: Ray nodes shielded from the stop signals; the driver's own local head.
- ``weight_sync``: the driver's side of the weight sync, one class per transport.
- ``recovery``: in-run replacement of a dead rollout or reward worker.
- ``faults``: which actor a fault came from, the bound on recoveries, the errors that end a run.
"""
