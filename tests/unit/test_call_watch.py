"""The deadlines the run learns for its actor calls (``orchestration/actors/call_watch.py``):
the rule, the bounded shutdown's process-tree kill, and, on a small local Ray, a slow call
that keeps beating is waited for while a stopped actor is named and killed, and a stopped
server behind a rollout worker's call is named and killed instead of the worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_armor.config.fields import call_deadline_bounds
from megatron_armor.config.schema import OrchestrationConfig
from megatron_armor.deadline_rule import DeadlineRule, quantile
from megatron_armor.orchestration.actors.call_kinds import CallKind
from megatron_armor.orchestration.actors.call_watch import (
    CallWatch,
    StopDuringCallError,
    StuckCallError,
    StuckServerError,
    judge,
    read_server_answers,
    start_actor,
)
from megatron_armor.orchestration.actors.process_trees import kill_trees, process_trees
from megatron_armor.orchestration.actors.watched import Watched, beating

pytestmark = pytest.mark.unit


def test_quantile_interpolates_between_ranks():
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.9) == pytest.approx(4.6)
    assert quantile([7.0], 0.9) == 7.0
    with pytest.raises(ValueError):
        quantile([], 0.5)


GENERATE, SCORE, UPDATES = CallKind.GENERATE, CallKind.SCORE, CallKind.UPDATES
STARTUP = CallKind.STARTUP


def test_a_kind_waits_for_the_cap_until_it_has_run_then_its_learned_deadline():
    rule = DeadlineRule(multiple=10.0, q=0.5, floor_s=1.0, cap_s=100.0)
    assert rule.deadline(GENERATE, 8) == 100.0
    rule.observe(GENERATE, 0.8, work=8)  # 0.1 s per prompt
    assert rule.deadline(GENERATE, 8) == pytest.approx(8.0)  # 10 x 0.1 x 8
    assert rule.deadline(GENERATE, 32) == pytest.approx(32.0)  # scaled by the work
    assert rule.deadline(GENERATE, 0.5) == 1.0  # the floor
    assert rule.deadline(GENERATE, 1000) == 100.0  # the cap
    assert rule.deadline(SCORE, 8) == 100.0  # every kind learns on its own


def test_the_deadline_follows_the_recent_durations_only():
    rule = DeadlineRule(multiple=2.0, q=1.0, floor_s=0.1, cap_s=1e9)
    rule.observe(UPDATES, 50.0)
    for _ in range(20):  # the history keeps the last 20: the slow first call is forgotten
        rule.observe(UPDATES, 1.0)
    assert rule.deadline(UPDATES) == pytest.approx(2.0)


def test_the_verdict_on_heartbeats_is_what_they_show():
    """``judge``: a silent actor or one in a call without progress past the limit is stuck; a
    waited actor that is idle means the call waits on another actor's work."""
    moving, idle, slow, silent = (True, 1.0), (False, 50.0), (True, 50.0), None
    verdict = judge({"a": moving, "b": slow, "c": silent}, limit=10.0)
    assert verdict.stuck == ("b", "c") and verdict.answered == {"a", "b"} and not verdict.idle
    assert judge({"a": idle, "b": idle}, 10.0).idle  # waiting for its arguments
    assert not judge({"a": idle, "b": moving}, 10.0).idle
    found = read_server_answers(["w0", "w1", "w2"], [
        {"killed": [{"pool": "policy", "index": 1}], "answered": 1},
        {"killed": [], "answered": 2},
        None,  # no answer: neither serving nor killed
    ])  # fmt: skip
    assert found.killed == [{"pool": "policy", "index": 1, "worker": "w0"}]
    assert found.serving == {"w1"}


def test_the_settings_are_checked():
    o = OrchestrationConfig(call_deadline_multiple=0.5, call_deadline_quantile=0.0,
                            call_deadline_floor_s=10.0, call_deadline_cap_s=5.0, stop_wait_s=0)  # fmt: skip
    problems = list(call_deadline_bounds(o))
    assert len(problems) == 4, problems
    assert problems[0].startswith("orchestration.call_deadline_multiple=0.5: must be >= 1")
    assert "orchestration.call_deadline_cap_s=5.0" in problems[2]
    assert list(call_deadline_bounds(OrchestrationConfig())) == []


def test_the_environment_caps_every_deadline(monkeypatch):
    watch = CallWatch()
    assert watch.cap() == 3600.0
    monkeypatch.setenv("ARMOR_CALL_TIMEOUT_S", "30")
    assert watch.cap() == 30.0


IGNORES_TERM = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    print(child.pid, flush=True)
    time.sleep(600)
""")


def gone(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def test_a_process_that_ignores_sigterm_is_killed_with_its_children():
    parent = subprocess.Popen([sys.executable, "-c", IGNORES_TERM], stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGTERM)  # ignored by both
    assert process_trees([parent.pid]) == [parent.pid, child]
    assert sorted(kill_trees([parent.pid])) == sorted([parent.pid, child])
    assert parent.wait(timeout=10) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while not gone(child):  # re-parented to init, which reaps it
        assert time.monotonic() < deadline, f"child {child} still alive"
        time.sleep(0.05)


@beating
class SleepyEngine(Watched):
    """A test engine: ``tokens`` tokens, ``pause`` seconds apart, each a heartbeat."""

    def generate(self, tokens: int, pause: float) -> int:
        from megatron_armor.heartbeat import beat

        for _ in range(tokens):
            time.sleep(pause)
            beat()
        return tokens

    def pid(self) -> int:
        return os.getpid()

    def echo(self, value):
        return value


class Stopped:
    received, received_at, name = signal.SIGTERM, 0.0, "SIGTERM"


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def half_second_watch(monkeypatch):
    """A call watch with 0.5 s deadlines that asks a heartbeat for 2 s."""
    import megatron_armor.orchestration.actors.call_watch as cw

    monkeypatch.setattr(cw, "HEARTBEAT_ANSWER_S", 2.0)
    return CallWatch(OrchestrationConfig(call_deadline_floor_s=0.5, call_deadline_cap_s=0.5))


def test_a_calls_kind_is_the_one_its_caller_names_never_read_from_text(local_ray):
    """The deadline a wait is bounded by and learns into is that of the ``CallKind`` its
    caller passes: a description holding another kind's words, a run name or a path changes
    nothing, a kind given as text is refused, and no code of the package makes a kind from a
    value (only ``CallKind.<MEMBER>`` at the call sites)."""
    watch = CallWatch(OrchestrationConfig(call_deadline_floor_s=0.5, call_deadline_cap_s=60.0))
    texts = ("rollout generate", "train step of run generate-7", "weight sync",
             "policy servers loading /runs/generate/sglang_weights/policy/policy-v3")  # fmt: skip
    for what in texts:
        assert watch.get(local_ray.put(1), CallKind.WEIGHT_PUSH, what, work=2.0) == 1
    assert list(watch.rule.history) == [CallKind.WEIGHT_PUSH]
    assert len(watch.rule.history[CallKind.WEIGHT_PUSH]) == len(texts)
    with pytest.raises(TypeError, match="must be a CallKind"):
        watch.get(local_ray.put(1), "generate", "rollout generate")
    assert kinds_made_from_values() == []


def kinds_made_from_values() -> list[str]:
    """Every use of ``CallKind`` in the package that is not a member named in the code
    (``CallKind.GENERATE``), an annotation, an import or an ``isinstance`` check:
    ``path:line``."""
    import ast
    from pathlib import Path

    import megatron_armor

    root = Path(megatron_armor.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        allowed = set()
        for node in ast.walk(tree):
            notes = []
            if isinstance(node, ast.arg | ast.AnnAssign) and node.annotation is not None:
                notes.append(node.annotation)
            if isinstance(node, ast.FunctionDef) and node.returns is not None:
                notes.append(node.returns)
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance":
                notes.extend(node.args[1:])
            if isinstance(node, ast.Attribute) and node.attr in CallKind.__members__:
                notes.append(node.value)
            allowed |= {id(n) for note in notes for n in ast.walk(note)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id == "CallKind" and id(node) not in allowed:
                if path.name != "call_kinds.py":
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_a_slow_call_that_moves_is_waited_for_and_a_stopped_actor_is_named_and_killed(
    local_ray, monkeypatch, tmp_path
):

    watch = half_second_watch(monkeypatch)
    engine = start_actor(watch, SleepyEngine, {"num_cpus": 0})
    pid = watch.get(engine.pid.remote(), STARTUP, "engine pid", timeout=120)  # its start-up
    watch.locate_actor(engine, {"node_id": local_ray.get_runtime_context().get_node_id(),
                                "ip": "127.0.0.1", "pid": pid}, 0)  # fmt: skip
    # 3 s of tokens 0.1 s apart: six deadlines of 0.5 s pass, each with progress in it
    assert watch.get(engine.generate.remote(30, 0.1), GENERATE, "rollout generate") == 30
    assert watch.pop_metrics() == {}

    os.kill(pid, signal.SIGSTOP)  # alive, never answers again
    started = time.monotonic()
    with pytest.raises(StuckCallError) as err:
        watch.get(engine.generate.remote(1, 0.0), GENERATE, "rollout generate")
    assert time.monotonic() - started < 10
    assert f"SleepyEngine 0 (pid {pid} on 127.0.0.1) is stuck: rollout generate (generate)" in str(
        err.value
    )
    assert err.value.actor_id == engine._actor_id.hex()
    deadline = time.monotonic() + 10
    while not gone(pid):
        assert time.monotonic() < deadline, "the stopped actor was not killed"
        time.sleep(0.05)
    assert watch.pop_metrics() == {"faults/stuck_unknown": 1.0}


def test_a_stop_signal_ends_a_wait_after_stop_wait_s(local_ray, tmp_path):
    watch = CallWatch(OrchestrationConfig(stop_wait_s=0.5), Stopped(), tmp_path)
    engine = start_actor(watch, SleepyEngine, {"num_cpus": 0})
    with pytest.raises(StopDuringCallError, match="SIGTERM arrived and rollout generate did not"):
        watch.get(engine.generate.remote(100, 0.1), GENERATE, "rollout generate")
    assert "none yet (a requeue starts the run over)" in str(
        pytest.raises(
            StopDuringCallError, watch.get, engine.generate.remote(100, 0.1), GENERATE, "x"
        ).value
    )
    local_ray.kill(engine)


def test_an_idle_actor_waiting_for_arguments_is_not_blamed_the_stuck_one_upstream_is(
    local_ray, monkeypatch
):

    watch = half_second_watch(monkeypatch)
    upstream, downstream = (start_actor(watch, SleepyEngine, {"num_cpus": 0}) for _ in range(2))
    node = local_ray.get_runtime_context().get_node_id()
    for i, actor in enumerate((upstream, downstream)):
        pid = watch.get(actor.pid.remote(), STARTUP, "pid", timeout=120)
        watch.locate_actor(actor, {"node_id": node, "ip": "127.0.0.1", "pid": pid}, i)
    stopped = watch.get(upstream.pid.remote(), STARTUP, "pid", timeout=120)
    os.kill(stopped, signal.SIGSTOP)
    # a weight push's shape: the downstream call waits for the upstream's result
    call = downstream.echo.remote(upstream.generate.remote(1, 0.0))
    with pytest.raises(StuckCallError) as err:
        watch.get(call, CallKind.WEIGHT_PUSH, "weight sync")
    assert f"SleepyEngine 0 (pid {stopped} on 127.0.0.1) is stuck: weight sync" in str(err.value)
    assert err.value.actor_id == upstream._actor_id.hex()
    assert watch.get(downstream.echo.remote(7), STARTUP, "echo", timeout=60) == 7  # left alone


def test_the_trainer_does_not_wait_forever_on_a_rollout_thread_that_gives_no_batch(monkeypatch):
    import threading

    from megatron_armor.orchestration.step.async_rollout import Collector

    monkeypatch.setenv("ARMOR_CALL_TIMEOUT_S", "0.5")  # the cap the watchdog uses
    from types import SimpleNamespace

    collector = Collector(SimpleNamespace(call_watch=CallWatch()), None, None)
    release = threading.Event()
    collector._thread = threading.Thread(target=release.wait, name="rollout-step-7", daemon=True)
    collector._thread.start()
    with pytest.raises(TimeoutError, match=r"the rollout thread \(rollout-step-7\) gave no batch"):
        collector.join()
    release.set()


FAKE_SERVER = textwrap.dedent("""
    import json, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def answer(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # /health_generate
            self.answer({})

        def do_POST(self):  # /generate: a sample in 0.1 s (or as long as asked)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            time.sleep(body.get("seconds", 0.1))
            self.answer({"text": "x"})

        def log_message(self, *args):
            pass

    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
""")


def server_alive(pid: int) -> bool:
    return not gone(pid)


def rollout_worker_class():
    """A rollout worker over one HTTP server that answers like SGLang's ``/generate`` and
    ``/health_generate``: the real ``SGLangEngine``, and the real services of a worker
    (``rollout_services``: the health the driver's probe asks, ``kill_wedged_servers``, and
    the weight intake of a push); named ``RolloutWorker``, the class the watch asks for its
    servers."""
    from megatron_armor.orchestration.actors.rollout_services import (
        EnginePools,
        HealthService,
        WeightCopies,
        WeightIntake,
    )

    @beating
    class RolloutWorker(Watched, WeightIntake, HealthService):
        def __init__(self, port: int, script: str, *args: str):
            from megatron_armor.config.schema import SGLangConfig
            from megatron_armor.rollout.sglang.engine import SGLangEngine
            from megatron_armor.rollout.sglang.launch import ManagedProcess

            engine = SGLangEngine("unused", SGLangConfig(base_port=port, num_engines=1))
            pools = EnginePools({"policy": engine}, 0)
            WeightIntake.__init__(self, pools, WeightCopies(False, 0), None)
            HealthService.__init__(self, pools)
            server = engine.servers[0]
            command = [sys.executable, script, str(port), *args]
            server.process = ManagedProcess(command, f"{server.url}/health_generate")
            server.process.start()
            server.process.wait_healthy(60, poll_s=0.1)

        def server_pid(self) -> int:
            return self.pools.policy.servers[0].process.process.pid

        def close(self) -> None:
            self.pools.close()

        def generate(self, samples: int, seconds: float = 0.1) -> int:
            engine, payload = self.pools.policy, {"seconds": seconds}
            for _ in range(samples):  # each answer beats (SGLangEngine._generate_one)
                engine._loop.run(engine._generate_one(engine.servers[0].url, payload))
            return samples

        def pid(self) -> int:
            return os.getpid()

    return RolloutWorker


def test_a_stopped_sglang_server_is_named_and_killed_and_its_worker_kept(
    local_ray, monkeypatch, tmp_path
):
    import megatron_armor.orchestration.actors.call_watch as cw
    from megatron_armor.net import free_port

    watch = half_second_watch(monkeypatch)
    monkeypatch.setattr(cw, "SERVER_PROBE_S", 2.0)
    script = tmp_path / "server.py"
    script.write_text(FAKE_SERVER)
    port = free_port()
    worker = start_actor(watch, rollout_worker_class(), {"num_cpus": 0}, port, str(script))
    pid = watch.get(worker.pid.remote(), STARTUP, "pid", timeout=120)
    node = local_ray.get_runtime_context().get_node_id()
    watch.locate_actor(worker, {"node_id": node, "ip": "127.0.0.1", "pid": pid}, 0)
    server = watch.get(worker.server_pid.remote(), STARTUP, "pid", timeout=60)
    # 2 s of samples 0.1 s apart: deadlines of 0.5 s pass, each with answers in it
    assert watch.get(worker.generate.remote(20), GENERATE, "rollout generate") == 20
    # one sample of 4 s: no answer for 8 deadlines, but the server answers /health_generate
    assert watch.get(worker.generate.remote(1, 4.0), GENERATE, "rollout generate") == 1
    assert server_alive(server) and watch.pop_metrics() == {}

    os.kill(server, signal.SIGSTOP)  # the server: alive, never answers again
    call = worker.generate.remote(1)
    with pytest.raises(StuckServerError) as err:
        watch.get(call, GENERATE, "rollout generate")
    message = str(err.value)
    assert f"SGLang policy server 0 at http://127.0.0.1:{port} (pid {server}" in message
    assert f"(pid {server}, RolloutWorker 0 (pid {pid} on 127.0.0.1))" in message
    assert "did not answer /health_generate within 2s: rollout generate" in message
    assert err.value.servers == [{"pool": "policy", "index": 0, "url": f"http://127.0.0.1:{port}",
                                  "pid": server, "worker": worker._actor_id.hex()}]  # fmt: skip
    assert gone(server), "the stopped server was not killed"
    assert watch.pop_metrics() == {"faults/stuck_sglang_server": 1.0}
    assert err.value.pending == [call]  # the recovery reads it (StuckServerError.settle)
    with pytest.raises(Exception, match="/generate failed"):  # the call on it fails, ...
        local_ray.get(call, timeout=60)
    assert watch.get(worker.pid.remote(), STARTUP, "pid", timeout=60) == pid  # its worker lives


SESSION_SERVER = textwrap.dedent("""
    import json, os, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    HANG = sys.argv[2]  # while this file exists, the next session opened never closes
    stuck = []

    class Handler(BaseHTTPRequestHandler):
        def answer(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # /health_generate: 503 while the scheduler is stuck, as SGLang's
            self.answer(503 if stuck else 200, {})

        def do_POST(self):  # the weight-update session's calls
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path == "/begin_weight_update" and os.path.exists(HANG):
                os.remove(HANG)  # once: the restarted server closes its sessions
                stuck.append(1)
            if self.path == "/end_weight_update" and stuck:
                time.sleep(3600)  # the session never closes
            self.answer(200, {"success": True})

        def log_message(self, *args):
            pass

    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
""")


def test_a_weight_update_session_that_never_closes_restarts_the_server_and_pushes_again(
    local_ray, monkeypatch, tmp_path, capsys
):
    """The push's ``/end_weight_update`` gets no answer and the server answers
    ``/health_generate`` 503: past the ``weight_push`` deadline the server is named and killed,
    and the ``sync`` phase's recovery restarts it with the pool's current weights (version 1)
    and sends the push of version 2 again. The trainer's side of a ``distributed`` push is a
    recorder (it streams nothing into the stand-in); everything else is the run's code."""
    import json
    from types import SimpleNamespace

    import megatron_armor.orchestration.actors.call_watch as cw
    from megatron_armor.config.schema import ArmorConfig
    from megatron_armor.net import free_port
    from megatron_armor.orchestration.actors.recovery import Recovery
    from megatron_armor.orchestration.actors.rollout_fleet import RolloutFleet, ServerHealth
    from megatron_armor.orchestration.actors.weight_sync import DistributedSync

    watch = half_second_watch(monkeypatch)  # the run's one watch
    monkeypatch.setattr(cw, "SERVER_PROBE_S", 2.0)
    script, hang = tmp_path / "server.py", tmp_path / "hang"
    script.write_text(SESSION_SERVER)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = (port, str(script), str(hang))
    worker = start_actor(watch, rollout_worker_class(), {"num_cpus": 0}, *args)
    pid = watch.get(worker.pid.remote(), STARTUP, "pid", timeout=120)
    node = local_ray.get_runtime_context().get_node_id()
    watch.locate_actor(worker, {"node_id": node, "ip": "127.0.0.1", "pid": pid}, 0)
    server = watch.get(worker.server_pid.remote(), STARTUP, "pid", timeout=60)

    fleet = RolloutFleet(watch, [worker], [0], [0], has_ref_pool=False)  # the run's workers
    pushes = []
    trainer = SimpleNamespace(actors=[], drop_sender=lambda pool: pushes.append(("new group",)),
                              push_weights=lambda version, weights, pool, target:
                              pushes.append((version, [t.url for t in target])) or 100)  # fmt: skip
    config = ArmorConfig()
    sync = DistributedSync(config, trainer, fleet)
    reference = SimpleNamespace(caches_anchors=False, forget_unsettled=lambda: None)
    rollout = SimpleNamespace(fleet=fleet, reference=reference,
                              health=ServerHealth(fleet, sync.resync))  # fmt: skip
    s = SimpleNamespace(
        config=config,
        run_dir=tmp_path,
        rollout=rollout,
        trainer=trainer,
        reward=SimpleNamespace(actors=[]),
        weight_sync=sync,
        call_watch=watch,
    )
    guard = Recovery(config)
    assert guard.guard(s, 1, "sync", lambda: sync.push_policy(1)) == 100
    version = CallKind.WEIGHT_VERSIONS
    assert watch.get(worker.pool_version.remote("policy"), version, "v") == 1
    assert watch.pop_metrics() == {}

    hang.touch()  # the next session never closes
    assert guard.guard(s, 2, "sync", lambda: sync.push_policy(2)) == 100
    out = capsys.readouterr().out
    assert f"stuck call: SGLang policy server 0 at {url} (pid {server}, RolloutWorker 0" in out
    assert "did not answer /health_generate within 2s: policy servers closing the weight" in out
    assert f"recovery: SGLang server {url} stuck during step 2 (sync; StuckServerError" in out
    assert gone(server), "the stuck server was not killed"
    restarted = watch.get(worker.server_pid.remote(), STARTUP, "pid", timeout=60)
    assert restarted != server and server_alive(restarted)
    # step 2's push, the heal's (a new group, the served version 1), step 2's push again
    assert pushes == [(1, [url]), (2, [url]), ("new group",), (1, [url]), (2, [url])]
    assert watch.get(worker.pool_version.remote("policy"), version, "v") == 2
    assert guard.pop_servers_restarted() == 1
    assert watch.pop_metrics() == {"faults/stuck_sglang_server": 1.0}
    (row,) = [json.loads(x) for x in (tmp_path / "recoveries.jsonl").read_text().splitlines()]
    assert (row["step"], row["phase"], row["reason"]) == (2, "sync", "stuck")
    assert row["actor"] == f"SGLang server {url}" and row["kind"] == "rollout"
    watch.get(worker.close.remote(), CallKind.CLOSE, "close", timeout=60)  # stops the server
    assert gone(restarted)
    local_ray.kill(worker)
