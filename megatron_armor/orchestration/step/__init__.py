"""The step: one pass of Algorithm 1 from the sampled queries to the logged metrics.

- ``loop``: the training loop as a short sequence of verbs on actor handles.
- ``phases``: the verbs both loops share (log-probs, updates, sync and reset, validation).
- ``anchor_rollout``: phase 1, generation and scoring with rejection sampling until B groups.
- ``async_rollout``: one-step-off rollout, the next step's generation beside this step's updates.
- ``acceptance``: a short step (fewer accepted groups than ``rollout.batch``).
- ``step_metrics``: the per-step metrics the orchestrator computes; per-step anchor files.
- ``update_guard``: the driver's count of skipped non-finite updates; a diverged run.
- ``progress``: progress bars for the rollout and training phases.
"""
