"""The processes of a run and their plumbing: the Ray actors and how the driver reaches them.

- ``actor_handles``: driver-side handles on the actors, one method per verb of the loop.
- ``workers``: the actor classes (TrainerWorker, RolloutWorker, RewardWorker).
- ``placement``: Ray start-up and actor placement for the three layouts.
- ``ray_node``: Ray nodes shielded from the stop signals; the driver's own local head.
- ``weight_sync``: the driver's side of the weight sync, one class per transport.
- ``recovery``: in-run replacement of a dead rollout or reward worker.
- ``faults``: which actor a fault came from, the bound on recoveries, the errors that end a run.
"""
