"""Unit tier: the ``armor train`` parent (``cli/supervise.py``): a driver Ray's core ends
(raylet or GCS lost) becomes a named line and exit 75; signals reach the driver; every other
exit is the driver's own. The drivers here are small Python scripts (no Ray)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron_armor.cli import supervise
from megatron_armor.orchestration.actors import ray_node

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]

PLASMA = "[FATAL] The connection to the plasma store is failed. Terminate the process."
GCS = "Failed to connect to GCS within 60 seconds. GCS may have been killed."


def driver(tmp_path: Path, body: str, unblock: bool = True) -> list[str]:
    """A driver script: adopts the pipe as ``armor`` does, takes the stop signals it starts
    with blocked (``unblock``; ``armor``'s own handler does it later), then runs ``body``."""
    script = tmp_path / "driver.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "from megatron_armor.supervisor_pipe import adopt_pipe, report_phase, report_rule\n"
        "from megatron_armor.supervisor_pipe import tell_supervisor\n"
        "from megatron_armor.cli.supervise import SHIELDED, die_with_parent\n"
        "parent = adopt_pipe()\n"
        "die_with_parent(parent)\n"
        + ("signal.pthread_sigmask(signal.SIG_UNBLOCK, SHIELDED)\n" if unblock else "")
        + textwrap.dedent(body)
    )
    return [sys.executable, str(script)]


def ray_killed_me(logs: Path, last_words: str) -> str:
    """Ray's core ending the driver: its last words in its own log, then ``_exit(1)``."""
    return textwrap.dedent(f"""
        tell_supervisor("ray_logs", {str(logs)!r})
        path = os.path.join({str(logs)!r}, f"python-core-driver-01000000_{{os.getpid()}}.log")
        open(path, "w").write("earlier lines\\n" + {last_words!r} + "\\n")
        os._exit(1)
    """)


@pytest.mark.parametrize(("words", "named"), [(PLASMA, "Ray's raylet"), (GCS, "Ray's GCS")])
def test_a_driver_ray_ended_is_named_and_requeued(tmp_path, capsys, words, named):
    code = supervise.supervise(["train"], driver(tmp_path, ray_killed_me(tmp_path, words)))
    err = capsys.readouterr().err
    assert code == 75
    assert f"armor train: lost {named}" in err and "exiting 75" in err and "--resume auto" in err


def test_other_exits_are_the_drivers_own(tmp_path, capsys):
    # exit 1 below Python without Ray's words (a crash of other code): still 1, nothing added
    assert supervise.supervise(["train"], driver(tmp_path, "os._exit(1)")) == 1
    body = "tell_supervisor('exit', 0)\nsys.exit(0)\n"
    assert supervise.supervise(["train"], driver(tmp_path, body)) == 0
    assert capsys.readouterr().err == ""
    # a driver that reported its exit keeps its code, even if Ray ended it after that or its
    # teardown crashed (a requeue stays a requeue), with a line saying so
    body = "tell_supervisor('exit', 3)\n" + ray_killed_me(tmp_path, PLASMA)
    assert supervise.supervise(["train"], driver(tmp_path, body)) == 3
    body = "tell_supervisor('exit', 75)\nos.abort()\n"
    assert supervise.supervise(["train"], driver(tmp_path, body)) == 75
    err = capsys.readouterr().err
    assert "ended with 1 after it exited 3: exiting 3" in err
    assert "ended with -6 after it exited 75: exiting 75" in err


def test_lost_control_plane_reads_ray_words():
    assert supervise.lost_control_plane("x\n" + PLASMA).startswith("Ray's raylet")
    assert supervise.lost_control_plane(GCS).startswith("Ray's GCS")
    assert supervise.lost_control_plane("Traceback ... RuntimeError") == ""
    assert supervise.lost_control_plane("Failed to connect to GCS, TaskEventBuffer will stop") == ""
    assert supervise.driver_log_text("", 123) == ""


def test_signals_reach_the_driver_once_or_twice_and_its_code_is_kept(tmp_path):
    """A SIGTERM to the parent alone (Slurm's sbatch) and to the whole group (a shell) both
    reach the driver, which exits 75 after its handler ran."""
    ready = tmp_path / "ready"
    body = f"""
        seen = []
        signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
        open({str(ready)!r}, "w").close()
        while not seen:
            time.sleep(0.05)
        time.sleep(0.3)
        tell_supervisor("exit", 75)
        sys.exit(75)
    """
    for group in (False, True):
        ready.unlink(missing_ok=True)
        parent = start_parent(driver(tmp_path, body))
        wait_for_file(ready, parent)
        os.killpg(parent.pid, signal.SIGTERM) if group else parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=30) == 75, parent.stderr.read()


def test_a_signal_before_the_drivers_handler_waits_for_it(tmp_path):
    """A SIGTERM to the parent while the driver still starts (no handler of its own yet) is
    held, not fatal: the driver is born with the stop signals blocked, and its handler, once in
    place, gets it (``armor``'s is ``StopSignal``: exit 75 before the first step)."""
    started = tmp_path / "started"
    body = f"""
        open({str(started)!r}, "w").close()
        time.sleep(1.0)  # importing torch and Ray, as far as the signal is concerned
        seen = []
        signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SHIELDED)
        tell_supervisor("exit", 75 if seen else 0)
        sys.exit(75 if seen else 0)
    """
    assert supervise.SHIELDED == ray_node.SHIELDED  # the signals armor's driver holds
    parent = start_parent(driver(tmp_path, body, unblock=False))
    wait_for_file(started, parent)
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=30) == 75, parent.stderr.read()


def sleeping_driver(tmp_path, command: list[str] | None = None, ready: Path | None = None):
    """A parent whose driver (``command``: one that sleeps) has started and written
    ``ready``; ``(parent, the driver's pid)``."""
    ready = ready or tmp_path / "ready"
    body = f"open({str(ready)!r}, 'w').close()\ntime.sleep(60)\n"
    parent = start_parent(command or driver(tmp_path, body))
    wait_for_file(ready, parent)
    child = next(p for p in children(parent.pid))
    return parent, child


def test_a_driver_killed_by_a_signal_kills_the_parent_by_it(tmp_path):
    parent, child = sleeping_driver(tmp_path)
    os.kill(child, signal.SIGKILL)
    assert parent.wait(timeout=30) == -signal.SIGKILL


def test_the_driver_dies_with_its_parent(tmp_path):
    parent, child = sleeping_driver(tmp_path)
    parent.kill()
    parent.wait(timeout=30)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


def start_parent(command: list[str]) -> subprocess.Popen:
    """``supervise`` in its own process (and process group) running ``command``."""
    code = f"import sys; from megatron_armor.cli import supervise; sys.exit(supervise.supervise(['train'], {command!r}))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def wait_for_file(path: Path, parent: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert parent.poll() is None and time.monotonic() < deadline, parent.stderr.read()
        time.sleep(0.05)


def children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(p) for p in text.split()]


def wait_until_stopped(pid: int, timeout: float = 30) -> None:
    """Until ``pid`` is in the stopped state (``T``): a SIGSTOP takes effect when the process
    next runs."""
    deadline = time.monotonic() + timeout
    while supervise.process_state(pid)[0] != "T":
        assert time.monotonic() < deadline, supervise.process_state(pid)
        time.sleep(0.01)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def test_the_driver_is_the_same_command_line(tmp_path):
    """An entry point that wraps the CLI (as the e2e tier's ``nan_advantages``) runs its own
    code in the driver too: the child is ``sys.orig_argv`` again, not ``-m megatron_armor.cli``."""
    entry = tmp_path / "entry.py"
    entry.write_text(
        textwrap.dedent("""
        import sys
        from megatron_armor.cli import supervise
        from megatron_armor.supervisor_pipe import adopt_pipe, tell_supervisor

        if supervise.wanted(None, ("train",)):
            sys.exit(supervise.supervise(sys.argv[1:]))
        print("driver", adopt_pipe() is not None, sys.argv[1:])
        tell_supervisor("exit", 42)
        sys.exit(42)
    """)
    )
    env = {k: v for k, v in os.environ.items() if k != "ARMOR_SUPERVISE"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-u", str(entry), "train", "x=1"], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 42, done.stderr
    assert done.stdout == "driver True ['train', 'x=1']\n"


# ---------------------------------------------------------------------- the driver watched
def test_a_driver_whose_main_loop_stops_is_named_and_killed_with_its_processes(tmp_path):
    """The main loop blocks (its heartbeat thread still answers) past its phase's deadline
    (here the cap, 2 s: the phase's first run): named, killed with the process it started,
    exit 75."""
    started = tmp_path / "started"
    body = f"""
        import subprocess
        report_rule(10, 0.9, 1, 2, 60)
        report_phase("step", 1)
        kid = subprocess.Popen(["sleep", "120"])
        open({str(started)!r}, "w").write(str(kid.pid))
        time.sleep(120)  # a call no deadline covers
    """
    parent = start_parent(driver(tmp_path, body))
    wait_for_file(started, parent)
    kid = int(started.read_text())
    assert parent.wait(timeout=60) == 75
    err = parent.stderr.read()
    assert re.search(
        r"made no progress for \d+s in phase step of step 1, past its deadline of 2s", err
    )
    assert "its heartbeat thread still answers: killed the driver and the 1 process" in err, err
    assert "exiting 75 for a requeue" in err and not alive(kid)


def test_a_stopped_driver_and_a_stop_signal_end_within_stop_wait_s(tmp_path):
    """SIGSTOP of the driver, then SIGTERM to the parent: the driver cannot act on it, so the
    parent ends it ``stop_wait_s`` (1 s) after the signal, long before the phase's deadline."""
    ready = tmp_path / "ready"
    body = f"""
        report_rule(10, 0.9, 30, 600, 1)
        report_phase("step", 1)
        open({str(ready)!r}, "w").close()
        time.sleep(120)
    """
    parent, child = sleeping_driver(tmp_path, driver(tmp_path, body), ready)
    os.kill(child, signal.SIGSTOP)
    wait_until_stopped(child)  # a SIGTERM pending beside the SIGSTOP would be taken first
    parent.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    assert parent.wait(timeout=60) == 75
    assert time.monotonic() - signalled < 30  # the cap is 600 s
    err = parent.stderr.read()
    assert "SIGTERM arrived and the driver did not move within orchestration.stop_wait_s=1s" in err
    assert not alive(child)


def test_a_lost_part_of_ray_reported_by_the_driver_ends_it_at_once(tmp_path):
    ready = tmp_path / "ready"
    body = f"""
        open({str(ready)!r} + ".tmp", "w").write(str(os.getpid()))  # before the parent ends it
        os.replace({str(ready)!r} + ".tmp", {str(ready)!r})
        tell_supervisor("lost", "raylet Ray's raylet of node ab12 at 127.0.0.1: the GCS marked it dead")
        time.sleep(120)
    """
    parent = start_parent(driver(tmp_path, body))
    wait_for_file(ready, parent)
    child = int(ready.read_text())
    assert parent.wait(timeout=60) == 75
    err = parent.stderr.read()
    assert "armor train: lost Ray's raylet of node ab12 at 127.0.0.1: the GCS marked it" in err
    assert not alive(child)


def test_the_same_exit_75_at_the_same_step_stops_requeueing(tmp_path, capsys):
    """Three exits 75 at step 2 for the same fault: 75, 75, then 70 naming it; a stop signal
    in between starts the count over."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    def exit_75(cause: str) -> list[str]:
        body = f"""
            tell_supervisor("run_dir", {str(run_dir)!r})
            report_phase("step", 2)
            tell_supervisor("cause", {cause!r})
            tell_supervisor("exit", 75)
            sys.exit(75)
        """
        return driver(tmp_path, body)

    died = "TrainerWorker 0 failed (ActorDiedError)"
    codes = [supervise.supervise(["train"], exit_75(c)) for c in (died, "signal", died, died)]
    assert codes == [75, 75, 75, 75]
    assert supervise.supervise(["train"], exit_75(died)) == 70
    err = capsys.readouterr().err
    assert f"exit 75 at step 2 for the 3rd time in a row with the same cause ({died})" in err
    assert "exiting 70, which slurm/armor.sbatch does not requeue" in err
