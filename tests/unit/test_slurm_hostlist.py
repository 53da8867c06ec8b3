"""Slurm host lists expanded in Python (``doctor/cluster.py``): ``armor doctor --all-nodes``
runs in the project's image, which has no ``scontrol``. Tier: unit."""

from __future__ import annotations

import pytest

from megatron_armor.doctor.cluster import expand_hostlist, slurm_placement

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node5", ["node5"]),
        ("gpu[01-03,07],login", ["gpu01", "gpu02", "gpu03", "gpu07", "login"]),
        ("armor-n[1-2]", ["armor-n1", "armor-n2"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("a[8-11]", ["a8", "a9", "a10", "a11"]),
        ("h100-[001-002]-ib", ["h100-001-ib", "h100-002-ib"]),
    ],
)
def test_host_lists_expand_as_scontrol_show_hostnames(nodelist, hosts):
    assert expand_hostlist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["a[1-", "a]", "a[x]", "a[3-1]", ""])
def test_a_malformed_host_list_is_named(bad):
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST"):
        expand_hostlist(bad)


def test_the_rendezvous_is_the_first_host_without_scontrol(monkeypatch):
    monkeypatch.setenv("PATH", "")  # no Slurm client (as in the container)
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "gpu[03-06]"}  # fmt: skip
    assert slurm_placement(env).master_addr == "gpu03"
