"""Fixtures of the Slurm tier: the CI cluster, the tiny artifacts, and jobs that never outlive
their test.

The cluster is started by ``slurm/ci/install_slurm.sh`` (``scripts/test.sh`` runs it): two
namespace nodes (``armor-n1``, ``armor-n2``) with slurmctld on the host, or one node where
namespaces are refused; ``$ARMOR_SLURM_STATE/topology`` says which and why. The session starts
by cancelling the jobs that earlier runs of this tier left behind (it says so) and by waiting
for idle nodes. Every job goes through :class:`SlurmJobs`, whose fixture cancels the test's
jobs at teardown, also after a failure or a timeout. All tier jobs are named ``JOB_NAME``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the tier's helper module, for its test files
sys.path.insert(1, str(Path(__file__).parent.parent / "e2e"))  # e2e_runs: the tiny artifacts

from e2e_runs import tiny_artifacts  # noqa: E402
from slurm_jobs import (  # noqa: E402
    REPO,
    Cluster,
    SlurmJobs,
    cancel_stale_jobs,
    check_subnet,
    make_workdir,
    missing_commands,
    slurm,
    topology,
    wait_idle,
)


@pytest.fixture(scope="session")
def cluster(request) -> Cluster:
    missing = missing_commands()
    if missing:
        pytest.skip(
            f"Slurm is not installed ({', '.join(missing)} missing): run "
            "`bash slurm/ci/install_slurm.sh` as root (scripts/test.sh does) to enable this tier"
        )
    kind, reason = topology()
    check_subnet(kind)
    ping = slurm("scontrol", "ping")
    assert ping.returncode == 0, (
        f"Slurm is installed but slurmctld does not answer: {ping.stdout}{ping.stderr}"
    )
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    say = reporter.write_line if reporter else print
    cancel_stale_jobs(say)
    nodes = sorted(set(slurm("sinfo", "-h", "-N", "-o", "%N").stdout.split()))  # (2 partitions)
    wait_idle(nodes)
    if kind == "two-node" and len(nodes) < 2:
        reason = f"the topology file says two-node but sinfo lists {nodes}"
    return Cluster(nodes, reason)


@pytest.fixture
def two_nodes(cluster) -> Cluster:
    """The two-node cluster; the test is skipped, with the reason, on one node."""
    if not cluster.two_nodes:
        pytest.skip(f"one Slurm node only ({cluster.single_node_reason}); two-node tests skipped")
    return cluster


@pytest.fixture(scope="session")
def tiny_dir(cluster) -> Path:
    """The tiny model + data: ``$ARMOR_TINY_DIR`` or ``artifacts/tiny`` (shared with the e2e
    tier), built with ``armor tiny`` when missing (once: ``e2e_runs.tiny_artifacts``)."""
    return tiny_artifacts().resolve()


@pytest.fixture(scope="session")
def cpu_image(cluster) -> Path:
    """The CPU image of the ``cpu-container`` preset (``slurm/ci/cpu_image.sh``)."""
    path = REPO / "megatron-armor-cpu"
    done = subprocess.run(["bash", str(REPO / "slurm" / "ci" / "cpu_image.sh"), str(path)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, f"cpu_image.sh failed:\n{done.stdout}{done.stderr}"
    return path


@pytest.fixture
def workdir(tiny_dir, tmp_path) -> Path:
    return make_workdir(tiny_dir, tmp_path)


@pytest.fixture
def jobs(cluster):
    """Submit jobs with ``jobs.submit(...)``; they are cancelled when the test ends, however."""
    submitted = SlurmJobs()
    yield submitted
    submitted.cancel_all()
