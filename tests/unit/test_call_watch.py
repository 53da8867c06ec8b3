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
from megatron_armor.orchestration.actors.call_watch import (
    CallWatch,
    DeadlineRule,
    StopDuringCallError,
    StuckCallError,
    StuckServerError,
    Watched,
    beating,
    kill_trees,
    kind_of,
    process_trees,
    quantile,
    start_actor,
)

pytestmark = pytest.mark.unit


def test_quantile_interpolates_between_ranks():
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.9) == pytest.approx(4.6)
    assert quantile([7.0], 0.9) == 7.0
    with pytest.raises(ValueError):
        quantile([], 0.5)


def test_a_kind_waits_for_the_cap_until_it_has_run_then_its_learned_deadline():
    rule = DeadlineRule(multiple=10.0, q=0.5, floor_s=1.0, cap_s=100.0)
    assert rule.deadline("generate", 8) == 100.0
    rule.observe("generate", 0.8, work=8)  # 0.1 s per prompt
    assert rule.deadline("generate", 8) == pytest.approx(8.0)  # 10 x 0.1 x 8
    assert rule.deadline("generate", 32) == pytest.approx(32.0)  # scaled by the work
    assert rule.deadline("generate", 0.5) == 1.0  # the floor
    assert rule.deadline("generate", 1000) == 100.0  # the cap
    assert rule.deadline("score", 8) == 100.0  # every kind learns on its own


def test_the_deadline_follows_the_recent_durations_only():
    rule = DeadlineRule(multiple=2.0, q=1.0, floor_s=0.1, cap_s=1e9)
    rule.observe("updates", 50.0)
    for _ in range(20):  # the history keeps the last 20: the slow first call is forgotten
        rule.observe("updates", 1.0)
    assert rule.deadline("updates") == pytest.approx(2.0)


def test_call_kinds_from_the_waits_descriptions():
    assert kind_of("rollout generate") == "generate"
    assert kind_of("rollout sample_reference") == "generate"
    assert kind_of("rollout generate_raw") == "validation"
    assert kind_of("reward scoring") == "score"
    assert kind_of("step log-probs") == "logprobs"
    assert kind_of("train step") == "updates"
    assert kind_of("weight sync (policy into the policy servers)") == "weight_push"
    assert kind_of("trainer reference reset") == "reset"
    assert kind_of("rollout state (kept for a recovery)") == "checkpoint"
    assert kind_of("compute intervals") == "compute intervals"


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


def half_second_watch(monkeypatch, *modules):
    """The run's call watch replaced (in ``call_watch`` and ``modules``, which import it by
    name) by one with 0.5 s deadlines that asks a heartbeat for 2 s."""
    import megatron_armor.orchestration.actors.call_watch as cw

    watch = CallWatch()
    watch.configure(OrchestrationConfig(call_deadline_floor_s=0.5, call_deadline_cap_s=0.5))
    for module in (cw, *modules):
        monkeypatch.setattr(module, "WATCH", watch)
    monkeypatch.setattr(cw, "HEARTBEAT_ANSWER_S", 2.0)
    return watch


def test_a_slow_call_that_moves_is_waited_for_and_a_stopped_actor_is_named_and_killed(
    local_ray, monkeypatch, tmp_path
):

    watch = half_second_watch(monkeypatch)
    engine = start_actor(SleepyEngine, {"num_cpus": 0})
    pid = watch.get(engine.pid.remote(), "engine pid", timeout=120)  # its start-up
    watch.locate_actor(engine, {"node_id": local_ray.get_runtime_context().get_node_id(),
                                "ip": "127.0.0.1", "pid": pid}, 0)  # fmt: skip
    # 3 s of tokens 0.1 s apart: six deadlines of 0.5 s pass, each with progress in it
    assert watch.get(engine.generate.remote(30, 0.1), "rollout generate") == 30
    assert watch.pop_metrics() == {}

    os.kill(pid, signal.SIGSTOP)  # alive, never answers again
    started = time.monotonic()
    with pytest.raises(StuckCallError) as err:
        watch.get(engine.generate.remote(1, 0.0), "rollout generate")
    assert time.monotonic() - started < 10
    assert f"SleepyEngine 0 (pid {pid} on 127.0.0.1) is stuck: rollout generate" in str(err.value)
    assert err.value.actor_id == engine._actor_id.hex()
    deadline = time.monotonic() + 10
    while not gone(pid):
        assert time.monotonic() < deadline, "the stopped actor was not killed"
        time.sleep(0.05)
    assert watch.pop_metrics() == {"faults/stuck_unknown": 1.0}


def test_a_stop_signal_ends_a_wait_after_stop_wait_s(local_ray, tmp_path):
    watch = CallWatch()
    watch.configure(OrchestrationConfig(stop_wait_s=0.5), Stopped(), tmp_path)
    engine = start_actor(SleepyEngine, {"num_cpus": 0})
    with pytest.raises(StopDuringCallError, match="SIGTERM arrived and rollout generate did not"):
        watch.get(engine.generate.remote(100, 0.1), "rollout generate")
    assert "none yet (a requeue starts the run over)" in str(
        pytest.raises(StopDuringCallError, watch.get, engine.generate.remote(100, 0.1), "x").value
    )
    local_ray.kill(engine)


def test_an_idle_actor_waiting_for_arguments_is_not_blamed_the_stuck_one_upstream_is(
    local_ray, monkeypatch
):

    watch = half_second_watch(monkeypatch)
    upstream, downstream = (start_actor(SleepyEngine, {"num_cpus": 0}) for _ in range(2))
    node = local_ray.get_runtime_context().get_node_id()
    for i, actor in enumerate((upstream, downstream)):
        pid = watch.get(actor.pid.remote(), "pid", timeout=120)
        watch.locate_actor(actor, {"node_id": node, "ip": "127.0.0.1", "pid": pid}, i)
    stopped = watch.get(upstream.pid.remote(), "pid", timeout=120)
    os.kill(stopped, signal.SIGSTOP)
    # a weight push's shape: the downstream call waits for the upstream's result
    with pytest.raises(StuckCallError) as err:
        watch.get(downstream.echo.remote(upstream.generate.remote(1, 0.0)), "weight sync")
    assert f"SleepyEngine 0 (pid {stopped} on 127.0.0.1) is stuck: weight sync" in str(err.value)
    assert err.value.actor_id == upstream._actor_id.hex()
    assert watch.get(downstream.echo.remote(7), "echo", timeout=60) == 7  # left alone


def test_the_trainer_does_not_wait_forever_on_a_rollout_thread_that_gives_no_batch(monkeypatch):
    import threading

    from megatron_armor.orchestration.step.async_rollout import Collector

    monkeypatch.setenv("ARMOR_CALL_TIMEOUT_S", "0.5")  # the cap the watchdog uses
    collector = Collector(None, None, None)
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
    ``/health_generate``: the real ``SGLangEngine`` and the real worker methods the driver's
    probe calls (``workers.RolloutWorker.kill_wedged_servers``); named ``RolloutWorker``, the
    class the watch asks for its servers."""
    from megatron_armor.orchestration.actors import workers

    @beating
    class RolloutWorker(Watched):
        pools = workers.RolloutWorker.pools
        _pool = workers.RolloutWorker._pool
        kill_wedged_servers = workers.RolloutWorker.kill_wedged_servers

        def __init__(self, port: int, script: str, *args: str):
            from megatron_armor.config.schema import SGLangConfig
            from megatron_armor.rollout.sglang.engine import SGLangEngine
            from megatron_armor.rollout.sglang.launch import ManagedProcess

            self.engine = SGLangEngine("unused", SGLangConfig(base_port=port, num_engines=1))
            self.ref_engine, self.index = None, 0
            server = self.engine.servers[0]
            command = [sys.executable, script, str(port), *args]
            server.process = ManagedProcess(command, f"{server.url}/health_generate")
            server.process.start()
            server.process.wait_healthy(60, poll_s=0.1)

        def server_pid(self) -> int:
            return self.engine.servers[0].process.process.pid

        def generate(self, samples: int, seconds: float = 0.1) -> int:
            engine, payload = self.engine, {"seconds": seconds}
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
    worker = start_actor(rollout_worker_class(), {"num_cpus": 0}, port, str(script))
    pid = watch.get(worker.pid.remote(), "pid", timeout=120)
    node = local_ray.get_runtime_context().get_node_id()
    watch.locate_actor(worker, {"node_id": node, "ip": "127.0.0.1", "pid": pid}, 0)
    server = watch.get(worker.server_pid.remote(), "pid", timeout=60)
    # 2 s of samples 0.1 s apart: deadlines of 0.5 s pass, each with answers in it
    assert watch.get(worker.generate.remote(20), "rollout generate") == 20
    # one sample of 4 s: no answer for 8 deadlines, but the server answers /health_generate
    assert watch.get(worker.generate.remote(1, 4.0), "rollout generate") == 1
    assert server_alive(server) and watch.pop_metrics() == {}

    os.kill(server, signal.SIGSTOP)  # the server: alive, never answers again
    call = worker.generate.remote(1)
    with pytest.raises(StuckServerError) as err:
        watch.get(call, "rollout generate")
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
    assert watch.get(worker.pid.remote(), "pid", timeout=60) == pid  # ... its worker lives on


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


def session_worker_class():
    """:func:`rollout_worker_class` with the real worker methods of a weight push into SGLang
    servers: opening and closing the update session, the versions, the heal's restart."""
    from megatron_armor.orchestration.actors import workers

    base = rollout_worker_class()
    names = ("begin_weight_update", "end_weight_update", "_servers_or_all", "_servers",
             "restart_dead_servers", "rejoin", "pool_version", "set_weight_version",
             "weight_targets", "close")  # fmt: skip
    return type("RolloutWorker", (base,), {n: getattr(workers.RolloutWorker, n) for n in names})


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

    import megatron_armor.orchestration.actors.actor_handles as actor_handles
    import megatron_armor.orchestration.actors.call_watch as cw
    import megatron_armor.orchestration.actors.recovery as recovery
    from megatron_armor.config.schema import ArmorConfig
    from megatron_armor.net import free_port
    from megatron_armor.orchestration.actors.actor_handles import RolloutActors
    from megatron_armor.orchestration.actors.recovery import Recovery
    from megatron_armor.orchestration.actors.weight_sync import DistributedSync

    watch = half_second_watch(monkeypatch, actor_handles, recovery)  # the run's one watch
    monkeypatch.setattr(cw, "SERVER_PROBE_S", 2.0)
    script, hang = tmp_path / "server.py", tmp_path / "hang"
    script.write_text(SESSION_SERVER)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    worker = start_actor(session_worker_class(), {"num_cpus": 0}, port, str(script), str(hang))
    pid = watch.get(worker.pid.remote(), "pid", timeout=120)
    node = local_ray.get_runtime_context().get_node_id()
    watch.locate_actor(worker, {"node_id": node, "ip": "127.0.0.1", "pid": pid}, 0)
    server = watch.get(worker.server_pid.remote(), "pid", timeout=60)

    rollout = object.__new__(RolloutActors)  # the run's handle over this one worker
    rollout.actors = rollout.policy_actors = rollout.reference_actors = [worker]
    rollout.has_ref_pool = rollout.caches_anchors = False
    pushes = []
    trainer = SimpleNamespace(actors=[], drop_sender=lambda pool: pushes.append(("new group",)),
                              push_weights=lambda version, weights, pool, target:
                              pushes.append((version, [t.url for t in target])) or 100)  # fmt: skip
    config = ArmorConfig()
    sync = DistributedSync(config, trainer, rollout)
    s = SimpleNamespace(config=config, run_dir=tmp_path, rollout=rollout, trainer=trainer,
                        reward=SimpleNamespace(actors=[]), weight_sync=sync)  # fmt: skip
    guard = Recovery(config)
    assert guard.guard(s, 1, "sync", lambda: sync.push_policy(1)) == 100
    assert watch.get(worker.pool_version.remote("policy"), "v") == 1 and watch.pop_metrics() == {}

    hang.touch()  # the next session never closes
    assert guard.guard(s, 2, "sync", lambda: sync.push_policy(2)) == 100
    out = capsys.readouterr().out
    assert f"stuck call: SGLang policy server 0 at {url} (pid {server}, RolloutWorker 0" in out
    assert "did not answer /health_generate within 2s: policy servers closing the weight" in out
    assert f"recovery: SGLang server {url} stuck during step 2 (sync; StuckServerError" in out
    assert gone(server), "the stuck server was not killed"
    restarted = watch.get(worker.server_pid.remote(), "pid", timeout=60)
    assert restarted != server and server_alive(restarted)
    # step 2's push, the heal's (a new group, the served version 1), step 2's push again
    assert pushes == [(1, [url]), (2, [url]), ("new group",), (1, [url]), (2, [url])]
    assert watch.get(worker.pool_version.remote("policy"), "v") == 2
    assert guard.pop_servers_restarted() == 1
    assert watch.pop_metrics() == {"faults/stuck_sglang_server": 1.0}
    (row,) = [json.loads(x) for x in (tmp_path / "recoveries.jsonl").read_text().splitlines()]
    assert (row["step"], row["phase"], row["reason"]) == (2, "sync", "stuck")
    assert row["actor"] == f"SGLang server {url}" and row["kind"] == "rollout"
    watch.get(worker.close.remote(), "close", timeout=60)  # stops the restarted server
    assert gone(restarted)
    local_ray.kill(worker)
