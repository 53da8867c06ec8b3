"""The e2e tier's runs: ``armor train`` of the tiny config in a subprocess, and their metrics.

Each :class:`Run` is ``armor train configs/tiny_cpu.yaml`` shortened to 4 steps with resets and
checkpoints every 2 steps, in its own process group and Ray temp dir, so that a signal or a
``kill -9`` of the group reaches the driver and the teardown finds every Ray process it started.
The end-of-run table and plots are made only when asked (``summary=True``: the reference run,
whose test checks them). ``module`` runs another entry point with the CLI's arguments (the fault
tests' ``nan_advantages``, on ``PYTHONPATH``).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_armor.observability.metrics import read_metrics
from megatron_armor.tiny.build import MARKER

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from process_group import (  # noqa: E402
    kill_leftovers,
    wait_until,
    wait_until_gone,
    wait_until_no_run_process,
)

REPO = Path(__file__).resolve().parents[2]


def tiny_artifacts(moe: bool = False) -> Path:
    """The tiny task's model and data (``armor tiny``, ``--moe`` for the mixture-of-experts
    variant), built when its completion marker is missing; ``ARMOR_TINY_DIR`` /
    ``ARMOR_TINY_MOE_DIR`` point to a directory elsewhere. The check and the build hold a lock
    beside the directory: the test streams of ``scripts/test.sh`` (and its own builds as they
    start) build it once, and a reader waits for the build under way."""
    env, name = ("ARMOR_TINY_MOE_DIR", "tiny_moe") if moe else ("ARMOR_TINY_DIR", "tiny")
    path = Path(os.environ.get(env, REPO / "artifacts" / name))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (path / MARKER).is_file():
            flags = ["--moe"] if moe else []
            subprocess.run([sys.executable, "-m", "megatron_armor.cli", "tiny", *flags,
                            "--out", str(path)], check=True, timeout=900, cwd=REPO)  # fmt: skip
    return path


RUN_TIMEOUT_S = 420
# The ARMOR runs draw anchors through the anchor cache, so the reset test also checks that a
# reset invalidates it and the resume test that it is restored; filter_only uses fresh samples.
CACHED = ("algo.anchor_source=cache",)


class Run:
    """One ``armor train`` subprocess with its own process group and Ray temp dir (``config``:
    another file of ``configs/``, e.g. the mixture-of-experts ``tiny_moe_cpu.yaml``)."""

    def __init__(
        self,
        out: Path,
        name: str,
        tiny: Path,
        *overrides: str,
        resume: str = "auto",
        env: dict[str, str] | None = None,
        summary: bool = False,
        module: str = "megatron_armor.cli",
        config: str = "tiny_cpu.yaml",
    ):
        self.run_dir = out / name
        self.ray_tmp = tempfile.mkdtemp(prefix="ar", dir="/tmp")  # short: unix socket paths
        self.log = (out / f"{name}.{time.time_ns()}.log").open("w")
        args = [
            f"run.output_dir={out}", f"run.name={name}", "run.steps=4", "run.ckpt_every=2",
            "algo.group_size=4", "algo.ref_n=2",
            "algo.reset.every=2", "rollout.batch=4", "rollout.gen_batch=8",
            "trainer.ppo_mini_batch=2", "validation.every=2", "validation.max_problems=8",
            "validation.n_samples=2", "logging.progress=false",
            f"trainer.model_path={tiny / 'model'}",
            f"data.train_files=[{tiny / 'data' / 'train.parquet'}]",
            f"data.val_files=[{tiny / 'data' / 'val.parquet'}]", *overrides,
        ]  # fmt: skip
        # Ray's defaults as a user gets them: token auth, loopback (no inherited RAY_AUTH_MODE)
        inherited = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
        env = dict(inherited, RAY_TMPDIR=self.ray_tmp, RAY_USAGE_STATS_ENABLED="0",
                   HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **(env or {}))  # fmt: skip
        cmd = [sys.executable, "-m", module, "train",
               str(REPO / "configs" / config), *args, "--resume", resume,
               *([] if summary else ["--no-summary"])]  # fmt: skip
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.cleanup()

    def wait_for(self, predicate, timeout: float = RUN_TIMEOUT_S) -> None:
        wait_until(self.proc, predicate, timeout, self.output)

    def steps_logged(self) -> list[int]:
        return [r["step"] for r in read_metrics(self.run_dir)] if self.run_dir.exists() else []

    def signal_group(self, sig: int) -> None:
        """``sig`` to the run's whole process group, as a shell or a terminal sends it."""
        os.killpg(self.proc.pid, sig)

    def wait_for_exit_of_ray(self, timeout: float = RUN_TIMEOUT_S) -> None:
        """Until no Ray process of this run is left (bounded)."""
        wait_until_gone(self.ray_tmp, timeout, self.output)

    def kill_group(self, nothing_left: bool = False) -> None:
        """``kill -9`` of this run's process group, then its clean-up. ``nothing_left``: first
        wait until no process of the run is left (Ray's run in their own session and stop with
        the driver; the checkpoint writer's die with the trainer), failing after 60 s. Off by
        default: outside Slurm, the SGLang servers of a killed run outlive it (on a cluster
        the job's cgroup ends them)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=60)
        if nothing_left:
            wait_until_no_run_process(self.ray_tmp, 60, self.output)
        self.cleanup()

    def cleanup(self) -> None:
        """Kill leftovers of this run (its process group; Ray processes under its temp dir)."""
        kill_leftovers(self.proc, self.ray_tmp)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)
        self.log.flush()

    def output(self) -> str:
        """The log's last 6000 characters (for a failed assertion's message)."""
        return self.text()[-6000:]

    def text(self) -> str:
        """The whole log so far: what a test looks for in it (a line printed early, such as a
        resume's, can be far from the end once the actors' warnings follow it)."""
        self.log.flush()
        return Path(self.log.name).read_text()
