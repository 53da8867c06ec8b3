"""Slurm tier: ``slurm/armor.sbatch`` on the CI cluster (two namespace nodes, or one).

Each job is the tiny CPU config through the real path: Ray head and workers started by the
sbatch file (token auth), ``armor train`` as the driver, checkpoints on a signal, ``scontrol
requeue`` and ``--resume auto``. On two nodes the trainer is TP=2 over gloo with one rank per
node and one uninterrupted run is the reference of the preemption test; on one node the same
tests run with one rank, and the two-node ones are skipped with the reason. Fixtures are in
``conftest.py``; every wait is bounded and every job is cancelled at teardown.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_jobs import (
    JOB_NAME,
    REPO,
    Job,
    SlurmJobs,
    container_env,
    job_field,
    make_workdir,
    wait_until,
)

from megatron_armor.observability.metrics import read_metrics, without_wall_clock

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from process_group import actor_pids  # noqa: E402  (the e2e tier's /proc reader)

pytestmark = pytest.mark.slurm

# The steps of the tiny job take under a second: 16 leave the preemption test's resumed run
# ~10 s after its trigger, room for Slurm's preemption (it lands seconds after the preempting
# job's submission, at a scheduler pass) to find the run still going.
STEPS = 16
PROFILED_STEP = 2
BRING_UP_DEADLINE_S = 15  # ARMOR_RAY_JOIN_TIMEOUT_S of the never-starting head test
NODE_LOSS_DEADLINE_S = 90  # from killing a node's processes to the job's end


def run_overrides(ranks: int) -> list[str]:
    """The reference run (also the preempted one): as many trainer ranks as the job has nodes
    (``trainer.world_size: auto``, one rank per node on CPU; TP over them), a torch profile of
    step 2 on each."""
    every = ",".join(str(r) for r in range(ranks))
    return [
        f"run.steps={STEPS}", "run.ckpt_every=100", f"trainer.tp={ranks}",
        "logging.profile=torch", f"logging.profile_steps=[{PROFILED_STEP}]",
        f"logging.profile_ranks=[{every}]",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def layout(cluster) -> int:
    """Nodes (= trainer ranks) of the runs: 2 on the two-node cluster, else 1."""
    return 2 if cluster.two_nodes else 1


@pytest.fixture(scope="module")
def reference(cluster, tiny_dir, layout, tmp_path_factory):
    """The uninterrupted run, shared by the completion and the preemption tests."""
    submitted = SlurmJobs()
    workdir = make_workdir(tiny_dir, tmp_path_factory.mktemp("reference"))
    try:
        job = submitted.submit(workdir, run_overrides(layout), nodes=layout)
        state = job.wait_done()
        yield job, state
    finally:
        submitted.cancel_all()


def test_the_tiny_config_runs_to_completion_with_traces_from_every_node(reference, layout):
    job, state = reference
    report = job.report()
    assert state == "COMPLETED", report
    assert job.field("ExitCode") == "0:0", report
    driver = job.driver_log()
    assert f"step {STEPS}/{STEPS}" in driver, report
    assert "orchestration.ray_address=" in driver  # the driver used the job's own Ray head
    assert f"orchestration.nodes={layout}" in driver  # the allocation, for world_size: auto
    resolved = (job.run_dir / "config.yaml").read_text()
    assert f"world_size: {layout}\n" in resolved, resolved
    nodes = job.nodes()
    assert len(nodes) == layout
    for node in nodes:
        assert (job.job_dir / f"ray-{node}.log").is_file(), report
    assert "RAY_AUTH_MODE=token" in (job.job_dir / "job.env").read_text()
    assert (job.job_dir / "ray_auth_token").stat().st_mode & 0o077 == 0  # the job's own token
    hosts = set()
    for rank in range(layout):
        path = job.run_dir / "profile" / f"trace_rank{rank}_step{PROFILED_STEP}.json"
        trace = json.loads(path.read_text())
        names = {str(event.get("name")) for event in trace["traceEvents"]}
        assert any(n.startswith("aten::") for n in names)  # forward ops of the trainer rank
        assert any(n.endswith("Backward0") for n in names)  # and its backward pass
        hosts.add(trace["armor_host"])
    assert hosts == set(nodes)  # one trainer rank on each node


def test_the_convert_and_eval_sbatch_files_export_and_evaluate_the_reference_run(
    reference, jobs, tmp_path
):
    """slurm/convert.sbatch exports the reference run's last checkpoint (with the run's model
    overrides in config.json), then slurm/eval.sbatch evaluates it with the run's config: two
    short one-node jobs, submitted from the run's working directory as the run was."""
    job, state = reference
    assert state == "COMPLETED", job.report()
    out, report = tmp_path / "hf", tmp_path / "eval"
    env = {**os.environ, "ARMOR_ENV": "cpu-ci", "ARMOR_ROOT": str(REPO),
           "ARMOR_PYTHON": sys.executable}  # fmt: skip
    logs = lambda: "".join(p.read_text()[-3000:] for p in tmp_path.glob("*.out"))  # noqa: E731

    def run_job(name: str, args: list[str]) -> None:
        cmd = ["sbatch", "--parsable", f"--job-name={JOB_NAME}", f"--chdir={job.workdir}",
               "--time=10", f"--output={tmp_path}/{name}.out",
               str(REPO / "slurm" / f"{name}.sbatch"), *args]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60, check=True)
        submitted = Job(done.stdout.strip().split(";")[0], job.workdir)
        jobs.jobs.append(submitted)  # cancelled at teardown
        assert submitted.wait_done(300) == "COMPLETED", logs()

    run_job("convert", ["--to-hf", str(job.run_dir), "latest", "--out", str(out)])
    exported = json.loads((out / "config.json").read_text())
    assert exported["rope_parameters"]["rope_theta"] == 10000.0  # tiny_cpu's model_overrides
    run_job("eval", ["--config", str(job.run_dir), "--model", str(out), "--step", str(STEPS),
                     "--k", "2", "--max-problems", "4", "--threads", "1", "--out", str(report)])  # fmt: skip
    results = json.loads((report / "eval.json").read_text())["results"]
    assert results["val"]["n"] == 4.0, results


def preempted_with_sigusr1(jobs, workdir, overrides: list[str], nodes: int):
    """A job of ``overrides`` sent SIGUSR1 once step 1 is logged: it checkpoints, exits 75, is
    requeued once and resumes from that checkpoint to the end. Returns ``(job, step)``, the step
    the signal's checkpoint holds."""
    job = jobs.submit(workdir, overrides, nodes=nodes)
    wait_until(lambda: f"step 1/{STEPS}" in job.driver_log(), 600, "the first step", job.report)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job.job_id], check=True, timeout=30)
    state = job.wait_done()
    out = job.report()
    assert state == "COMPLETED", out
    assert job.field("Restarts") == "1", out
    driver = job.driver_log()
    saved = re.search(r"SIGUSR1: checkpoint of step (\d+) written .*; exiting 75", driver)
    assert saved, out
    step = int(saved.group(1))
    assert 1 <= step < STEPS, out  # preempted mid-run
    assert "requeueing job" in job.out.read_text()
    assert re.search(rf"resumed from \S+step_{step:06d} at step {step}", driver), out
    assert f"step {STEPS}/{STEPS}" in driver.split("=== restart 1")[-1], out
    return job, step


def assert_same_metrics(job, reference) -> None:
    """Every step's metrics of ``job`` equal those of the ``reference`` job (timings excepted)."""
    expected = {r["step"]: without_wall_clock(r) for r in read_metrics(reference.run_dir)}
    got = {r["step"]: without_wall_clock(r) for r in read_metrics(job.run_dir)}
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        assert got[s] == expected[s], s


def test_preemptions_of_two_nodes_checkpoint_the_step_requeue_and_resume_with_its_metrics(
    reference, two_nodes, cpu_image, workdir, jobs
):
    """The reference run in containers (``cpu-container``: every step its own container, as
    pyxis makes them), stopped twice: ``scancel --signal=TERM --full`` once step 1 is logged
    (Slurm signals the batch step only: the batch shell asks the driver's step with SIGUSR1,
    srun would turn a SIGTERM into a SIGKILL), then Slurm's own preemption (a job of partition
    ``ci-urgent``: PreemptMode=REQUEUE, SIGTERM to the job's steps at the start of GraceTime)
    once the resumed run logged its next step. Each time the driver checkpoints its current
    step while the Ray nodes and trainer ranks of both nodes live, the job requeues and
    ``--resume auto`` continues; every step's metrics are the uninterrupted run's."""
    assert reference[1] == "COMPLETED", reference[0].report()
    job = jobs.submit(workdir, run_overrides(2), nodes=2, env=container_env(workdir))
    started = lambda restart, text: lambda: text in since(job, restart)  # noqa: E731
    wait_until(started(0, f"step 1/{STEPS}"), 600, "the first step", job.report)
    subprocess.run(["scancel", "--signal=TERM", "--full", job.job_id], check=True, timeout=30)
    wait_until(started(1, "resumed from"), 600, "the first resume", job.report)
    first = checkpointed(since(job, 0), "SIGUSR1")  # the batch shell's request
    wait_until(started(1, f"step {first + 1}/{STEPS}"), 600, "a step after it", job.report)
    urgent = subprocess.run(["sbatch", "--parsable", "-p", "ci-urgent", "-N", "2",
                             f"--job-name={JOB_NAME}", f"--output={workdir}/urgent-%j.out",
                             "--wrap", "true"], capture_output=True, text=True, timeout=60,
                            check=True)  # fmt: skip
    jobs.jobs.append(Job(urgent.stdout.strip(), workdir))  # cancelled at teardown
    state = job.wait_done()
    out = job.report()
    assert state == "COMPLETED" and job.field("Restarts") == "2", out
    second = checkpointed(since(job, 1), "SIGTERM")  # Slurm's own, to the driver's step
    assert 1 <= first < second < STEPS, out  # each the step in flight, none lost
    assert re.search(rf"resumed from \S+step_{second:06d} at step {second}", since(job, 2)), out
    assert job_field(jobs.jobs[-1].job_id, "JobState") == "COMPLETED"  # the preemptor ran
    states = (job.job_dir / "job_states").read_text()  # the run lock's view in the container
    assert f"{job.job_id} RUNNING" in states, states
    assert_same_metrics(job, reference[0])


def since(job: Job, restart: int) -> str:
    """The driver log of start ``restart`` of ``job`` ('' before it began)."""
    marker = f"=== restart {restart} "
    text = job.driver_log()
    return text.split(marker, 1)[1].split("=== restart", 1)[0] if marker in text else ""


def checkpointed(log: str, signal_name: str) -> int:
    """The step whose checkpoint ``signal_name`` made (the driver's message), asserted."""
    saved = re.search(rf"{signal_name}: checkpoint of step (\d+) written .*; exiting 75", log)
    assert saved, log[-4000:]
    return int(saved.group(1))


def test_a_rollout_worker_killed_mid_run_is_replaced_and_the_job_ends_with_its_metrics(
    reference, layout, workdir, jobs
):
    """kill -9 of the job's rollout worker once step 1 is logged: the run replaces it in place
    (``orchestration/actors/recovery.py``). On two nodes, once that recovery is logged, SIGSTOP
    of a worker on the second node (alive, never answering: found past its call deadline,
    named, killed on its node): the reward worker when Ray placed it there, replaced in the
    run and the job never requeued; else the trainer rank there, which stops the run with
    exit 75, and the job is requeued once and resumes from the newest checkpoint. Every step's
    metrics are the uninterrupted run's. The job lowers ``orchestration.call_deadline_floor_s``
    to 15 s (default 30 s) to keep the tier short and checkpoints every 2 steps."""
    assert reference[1] == "COMPLETED", reference[0].report()
    overrides = [
        *run_overrides(layout),
        "run.ckpt_every=2",
        "orchestration.call_deadline_floor_s=15",
    ]
    job = jobs.submit(workdir, overrides, nodes=layout)
    wait_until(lambda: f"step 1/{STEPS}" in job.driver_log(), 600, "the first step", job.report)
    wait_until(lambda: len(job_actor_pids(job.job_id, "RolloutWorker")) == 1, 60,
               "the job's rollout worker", job.report)  # fmt: skip
    (pid,) = job_actor_pids(job.job_id, "RolloutWorker")
    cls, stuck_pid = a_worker_on_the_second_node(job) if layout == 2 else ("", 0)
    os.kill(pid, signal.SIGKILL)
    recovered = "recovery: RolloutWorker 0 died during step"
    if cls:  # the steps take about a second: the stopped worker is called again before the end
        wait_until(lambda: recovered in job.driver_log(), 120, "the recovery", job.report)
        os.kill(stuck_pid, signal.SIGSTOP)
        wait_until(lambda: "stuck call: " in job.driver_log(), 120, f"{cls} {stuck_pid} found "
                   "stuck", job.report)  # fmt: skip
    state = job.wait_done()
    out = job.report()
    assert state == "COMPLETED", out
    driver = job.driver_log()
    first = driver.split("=== restart 1")[0]
    assert recovered in first, out
    requeued = cls == "TrainerWorker"  # a trainer rank's state lives only in its process
    assert job.field("Restarts") == ("1" if requeued else "0"), out
    if requeued:
        assert re.search(r"TrainerWorker \d+ failed \(StuckCallError: TrainerWorker", first), out
        assert "exiting 75 for a requeue" in first, out
    elif cls:
        assert re.search(rf"recovery: {cls} \d+ stuck during step", driver), out
        assert "Traceback" not in driver, out
    if cls:
        assert stuck_pid not in job_actor_pids(job.job_id, cls)  # killed, not left stopped
    assert pid not in job_actor_pids(job.job_id, "RolloutWorker")
    assert_same_metrics(job, reference[0])


def a_worker_on_the_second_node(job) -> tuple[str, int]:
    """``(class, pid)`` of a worker of ``job`` on its second node: the reward worker if Ray
    placed it there, else the trainer rank there (one per node)."""
    second = [n for n in job.nodes() if n != job.field("BatchHost")][0]
    there = set(node_pids(second))
    found = [(cls, pid) for cls in ("RewardWorker", "TrainerWorker")
             for pid in job_actor_pids(job.job_id, cls) if pid in there]  # fmt: skip
    assert found, f"no reward worker or trainer rank of the job on {second}\n{job.report()}"
    return found[0]


def node_pids(node: str) -> list[int]:
    """The processes in ``node``'s network namespace (``netns_nodes.sh pids``)."""
    return [int(p) for p in subprocess.run(
        ["bash", str(REPO / "slurm" / "ci" / "netns_nodes.sh"), "pids", node],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout.split()]  # fmt: skip


ASYNC = [f"run.steps={STEPS}", "run.ckpt_every=100", "orchestration.async_rollout=one_step",
         "algo.reset.every=4"]  # fmt: skip
"""One trainer rank (the cpu layout's pipeline needs a core for it and one for the engine):
each step draws the next step's rollout beside its updates, but every 4th (a reset) and the
last, which drain."""


@pytest.fixture(scope="module")
def async_reference(cluster, tiny_dir, tmp_path_factory):
    """The uninterrupted job with ``orchestration.async_rollout=one_step``."""
    submitted = SlurmJobs()
    workdir = make_workdir(tiny_dir, tmp_path_factory.mktemp("async_reference"))
    try:
        job = submitted.submit(workdir, ASYNC, nodes=1)
        yield job, job.wait_done()
    finally:
        submitted.cancel_all()


def test_async_rollout_sigusr1_requeues_and_resumes_with_the_batch_in_flight(
    async_reference, workdir, jobs
):
    """SIGUSR1 once step 1 is logged: the step's checkpoint holds the next step's rollout
    (drawn beside its updates) and the trainer's behavior weights; the requeued job trains that
    batch and every step's metrics are the uninterrupted async job's."""
    from megatron_armor.orchestration.run.run_state import RunState

    reference, state = async_reference
    assert state == "COMPLETED", reference.report()
    job, step = preempted_with_sigusr1(jobs, workdir, ASYNC, 1)
    held = RunState.load(job.run_dir / "checkpoints" / f"step_{step:06d}")
    assert (held.pending.get("step") == step + 1) == (step % 4 != 0), held.pending.keys()
    drained = [r["async/drained"] for r in read_metrics(job.run_dir)]
    assert drained == [float(s % 4 == 0 or s == STEPS) for s in range(1, STEPS + 1)]
    assert_same_metrics(job, reference)


def job_actor_pids(job_id: str, cls: str) -> list[int]:
    """Live processes of the Slurm job ``job_id``'s Ray actors of class ``cls``."""
    return actor_pids(job_id, cls, env="SLURM_JOB_ID")


def test_a_worker_node_killed_mid_run_stops_the_job_with_a_named_error(two_nodes, workdir, jobs):
    job = jobs.submit(workdir, [*run_overrides(2)[:1], "run.ckpt_every=1", "trainer.world_size=2",
                                "trainer.tp=2"], nodes=2)  # fmt: skip
    first = job.run_dir / "checkpoints" / "step_000001" / "meta.json"
    wait_until(first.is_file, 600, "the checkpoint of step 1", job.report)
    worker = [n for n in job.nodes() if n != job.field("BatchHost")][0]
    killed = kill_ray_processes(worker)
    assert killed, f"no Ray process found on {worker}"
    start = time.monotonic()
    state = job.wait_done(NODE_LOSS_DEADLINE_S + 60)
    took = time.monotonic() - start
    out = job.report()
    assert state == "FAILED", out
    assert took < NODE_LOSS_DEADLINE_S, f"the job took {took:.0f}s to stop\n{out}"
    assert f"Ray node {worker} left during the run" in out, out
    assert f"ray-{worker}.log" in out
    assert first.is_file()  # the last checkpoint is kept
    assert job.field("Restarts") == "0"  # a lost node is not a preemption: no requeue


def test_a_head_that_never_starts_fails_the_job_within_the_deadline(cluster, workdir, jobs):
    env = {
        "ARMOR_RAY": str(REPO / "tests" / "slurm" / "unresponsive_head.py"),
        "ARMOR_RAY_JOIN_TIMEOUT_S": str(BRING_UP_DEADLINE_S),
    }
    job = jobs.submit(workdir, ["run.steps=1"], env=env)
    wait_until(lambda: job.field("JobState") == "RUNNING" or job.out.is_file(), 120, "job start")
    start = time.monotonic()
    state = job.wait_done(BRING_UP_DEADLINE_S + 90)
    took = time.monotonic() - start
    out = job.report()
    assert state == "FAILED", out
    head = job.field("BatchHost")
    assert "the Ray head at" in out and f"on node {head} did not answer within" in out, out
    assert str(job.job_dir / f"ray-{head}.log") in out
    assert took < BRING_UP_DEADLINE_S + 60, f"{took:.0f}s\n{out}"
    assert not job.driver_log()  # the driver never started


def kill_ray_processes(node: str) -> list[int]:
    """``kill -9`` every process of the job on ``node`` (its network namespace), leaving the
    node's slurmd and the step daemons (slurmstepd) alone."""
    killed = []
    for pid in node_pids(node):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name not in ("slurmd", "slurmstepd"):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


def test_join_check_names_the_missing_node_and_fails_fast_when_a_launcher_dies(tmp_path):
    """slurm/lib: a head from ray_node.sh, then the join check for the head plus a node that
    never comes."""
    port = 20000 + os.getpid() % 20000
    env = {
        **os.environ,
        "ARMOR_ROOT": str(REPO),
        "ARMOR_RAY": str(Path(sys.executable).parent / "ray"),
        "ARMOR_PYTHON": sys.executable,
        "ARMOR_RAY_PORT": str(port),
        "ARMOR_RAY_NUM_CPUS": "1",
        "ARMOR_RAY_OBJECT_STORE_MB": "128",
        "ARMOR_RAY_TEMP_DIR": f"/tmp/ray-armor-t{os.getpid()}",
        "SLURMD_NODENAME": "headnode",
        "RAY_AUTH_MODE": "disabled",
    }
    log = open(tmp_path / "ray-head.log", "w")
    head = subprocess.Popen(
        [str(REPO / "slurm" / "lib" / "ray_node.sh"), "head"], env=env, stdout=log, stderr=log
    )
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        waiter = [*wait_command(f"{head_ip(env)}:{port}"), "--logs", str(tmp_path)]
        ok = subprocess.run([*waiter, "--nodes", "headnode", "--timeout", "60"],
                            capture_output=True, text=True, timeout=180, env=env)  # fmt: skip
        assert ok.returncode == 0, ok.stderr
        # 30 s: the head answers within it on a loaded 2-core machine (its probe imports Ray)
        late = subprocess.run([*waiter, "--nodes", "headnode,ghost-node", "--timeout", "30"],
                              capture_output=True, text=True, timeout=180, env=env)  # fmt: skip
        assert late.returncode == 1, late.stderr
        assert "ghost-node missing" in late.stderr and "not joined after 30s" in late.stderr
        assert str(tmp_path / "ray-ghost-node.log") in late.stderr
        start = time.monotonic()
        fast = subprocess.run(
            [*waiter, "--nodes", "headnode,ghost-node", "--timeout", "600", "--watch", f"ghost-node={dead.pid}"],
            capture_output=True, text=True, timeout=180, env=env,
        )  # fmt: skip
        assert fast.returncode == 1 and "its Ray start exited" in fast.stderr
        assert time.monotonic() - start < 60  # did not wait for the 600 s deadline
    finally:
        head.send_signal(
            signal.SIGUSR2
        )  # stops the Ray processes it started (orchestration/actors/ray_node.py)
        head.wait(timeout=60)
        log.close()


def test_join_check_holds_its_deadline_when_the_head_never_answers(tmp_path):
    """A head that accepts connections but never answers blocks ``ray.init``; the check still
    fails on its deadline, naming the head node and its log."""
    head = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "slurm" / "unresponsive_head.py"), "start",
         "--head", "--port=0", "--node-ip-address=127.0.0.1"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        port = re.search(r", (\d+)\)", head.stdout.readline()).group(1)
        start = time.monotonic()
        done = subprocess.run(
            [*wait_command(f"127.0.0.1:{port}"), "--nodes", "n1,n2", "--timeout", "8",
             "--logs", str(tmp_path)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        took = time.monotonic() - start
        assert done.returncode == 1, done.stderr
        assert (
            f"the Ray head at 127.0.0.1:{port} on node n1 did not answer within 8s" in done.stderr
        )
        assert "(its port is open)" in done.stderr and str(tmp_path / "ray-n1.log") in done.stderr
        assert took < 8 + 15, took  # the deadline, plus starting Python
    finally:
        head.kill()
        head.wait()


def wait_command(address: str) -> list[str]:
    return [sys.executable, str(REPO / "slurm" / "lib" / "wait_for_ray_nodes.py"),
            "--address", address]  # fmt: skip


def head_ip(env: dict[str, str]) -> str:
    out = subprocess.run(
        ["bash", "-c", f"source {REPO}/slurm/lib/common.sh && node_ip"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    return out.stdout.strip()


REPEATS = 3  # ARMOR_REQUEUE_REPEATS' default


def test_a_job_whose_every_start_fails_the_same_way_stops_after_three_tries(cluster, workdir, jobs):
    """Every start of the job exits 75 at step 2 with the same cause (``repeating_fault.py``):
    the first two are requeued, the third exits 70 naming the cause and the job ends FAILED
    after 3 starts, not after ``ARMOR_MAX_RESTARTS`` (50)."""
    driver = f"{sys.executable} {REPO / 'tests' / 'slurm' / 'repeating_fault.py'} train"
    job = jobs.submit(workdir, [], env={"ARMOR_DRIVER": driver})
    state = job.wait_done()
    out = job.report()
    assert state == "FAILED" and job.field("ExitCode") == "70:0", out
    assert job.field("Restarts") == str(REPEATS - 1), out
    said = "exit 75 at step 2 for the 3rd time in a row with the same cause (TrainerWorker 0 failed"
    assert said in job.driver_log() and "exiting 70, which slurm/armor.sbatch does not" in out, out
    rows = [json.loads(x) for x in (job.run_dir / "requeues.jsonl").read_text().splitlines()]
    assert [(r["step"], r["restart"], r["slurm_job"]) for r in rows] == [
        (2, restart, job.job_id) for restart in range(REPEATS)
    ], rows


def test_a_plain_scancel_ends_the_job_and_is_not_requeued(cluster, workdir, jobs):
    """``scancel JOBID`` (no ``--signal``): Slurm marks the job ended, then its SIGTERM reaches
    the driver, which checkpoints and exits 75 as on a preemption (``checkpointing_driver.py``
    stands for it); the batch shell sees the job no longer ``RUNNING`` and does not requeue
    it: the job ends CANCELLED after one start, not revived by ``scontrol requeue``."""
    driver = f"{sys.executable} {REPO / 'tests' / 'slurm' / 'checkpointing_driver.py'}"
    job = jobs.submit(workdir, [], env={"ARMOR_DRIVER": driver})
    wait_until(lambda: "waiting for a stop signal" in job.driver_log(), 300, "the driver's start",
               job.report)  # fmt: skip
    subprocess.run(["scancel", job.job_id], check=True, timeout=30)
    state = job.wait_done()
    out = job.report()
    assert state == "CANCELLED" and job.field("Restarts") == "0", out
    assert "SIGTERM: checkpoint of step 1 written" in job.driver_log(), out
    assert "driver exited 75, but the job is COMPLETING (scancel): not requeued" in out, out
