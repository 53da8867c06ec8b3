"""A run's lifecycle: what opens, holds, saves, resumes and watches a run.

- ``session``: set-up and tear-down of a run (Ray, actor handles, data, sinks, save/restore).
- ``run_dir``: opening a run directory before anything starts (lock, clean-up, resume, config).
- ``run_lock``: one writer per run directory (``run_dir/.lock``).
- ``run_state``: what the orchestrator checkpoints besides the trainer (RunState); StopSignal.
- ``checkpoints``: atomic, verified, rotating checkpoint directories; keep-best.
- ``disk_space``: free space before a save, and a save that ran out of it.
- ``resume_check``: a resume checkpoint's model shapes against the config, before Ray starts.
- ``run_watch``: keep-best, the over-optimization stop and a long run's warnings.
- ``finish``: a finished run's summary table and plots.
- ``host_usage``: host memory of every process of the run, the run directory's size.
"""
