"""Deadlines the run learns for its calls to the actors, and what happens past them
(docs/orchestration.md, "Stuck calls").

Every wait on an actor goes through the run's :class:`CallWatch`, with the :class:`CallKind`
its caller names (generate, score, log-probs, updates, weight push, reset, validation,
checkpoint, and the smaller calls, each a kind of its own). A kind has a deadline from its own
recent durations (:class:`DeadlineRule`): ``call_deadline_multiple`` x the
``call_deadline_quantile`` of the last :data:`HISTORY` durations per unit of work, x the work
of this call, within ``call_deadline_floor_s`` and ``call_deadline_cap_s`` (and
``ARMOR_CALL_TIMEOUT_S`` when set); a kind's first call waits for the cap. At the deadline the
driver asks each actor that has not answered for its heartbeat (``heartbeat.py``, answered
from a thread of its own: ``watched.py``), and
:func:`judge` reads the answers: one that made progress within the deadline gets the deadline
again. One that did not is *stuck*: it is named (class, node, pid, the call, how long it
waited), its process and the processes it started are killed, and :class:`StuckCallError` (a
``TimeoutError`` naming the actor) is handled like a dead actor (``recovery.py``: a rollout or
reward worker replaced, anything else exit 75). Before a rollout worker that answers its
heartbeat is called stuck, it asks its SGLang servers' ``/health_generate``
(:meth:`CallWatch.probe_servers`): a server without a 200 is the one stuck (killed by its
worker, :class:`StuckServerError`: ``recovery.py`` restarts it with the current weights and
does the phase again); a worker whose servers all answer waits on servers that move (another
deadline).

After a stop signal (``run_state.StopSignal``) no wait lasts past ``orchestration.stop_wait_s``
from the signal: :class:`StopDuringCallError` ends the run with exit 75 on the newest complete
checkpoint without waiting for the call, within Slurm's signal lead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from megatron_armor import env_settings
from megatron_armor.deadline_rule import HISTORY, DeadlineRule
from megatron_armor.orchestration.actors.call_kinds import CallKind
from megatron_armor.orchestration.actors.faults import RequeueError, newest_checkpoint_text
from megatron_armor.orchestration.actors.process_trees import kill_on_node
from megatron_armor.orchestration.actors.watched import CONCURRENCY_GROUPS
from megatron_armor.orchestration.run.run_state import EXIT_REQUEUE
from megatron_armor.supervisor_pipe import advance

POLL_S = 1.0  # how often a wait looks at the stop signal
HEARTBEAT_ANSWER_S = 5.0  # how long an actor gets to answer its heartbeat call
PROBE_TIMEOUT_S = 60.0  # the task that asks them (its worker may have to start)
SERVER_PROBE_S = 30.0  # /health_generate: SGLang answers 503 after 20 s of a silent scheduler
CHANGE_LOGGED = 1.25  # a kind's deadline is logged again when it moves by this factor
ACTOR_KINDS = {"TrainerWorker": "trainer", "RolloutWorker": "rollout", "RewardWorker": "reward"}


def env_cap() -> float | None:
    """``ARMOR_CALL_TIMEOUT_S`` when set: a cap on every deadline."""
    return env_settings.value("ARMOR_CALL_TIMEOUT_S")


Beat = tuple[bool, float] | None
"""An actor's heartbeat: ``(busy, seconds since progress)``; ``None``: no answer."""


def is_stuck(beat: Beat, limit: float) -> bool:
    """A heartbeat that did not come, or a call under way without progress for ``limit``."""
    return beat is None or (beat[0] and beat[1] > limit)


@dataclass(frozen=True)
class Verdict:
    """What the heartbeats of some actors show, ``limit`` seconds into a wait."""

    stuck: tuple[str, ...]
    """The actors (hex ids) that did not answer or made no progress within the limit."""
    answered: frozenset[str]
    """The actors that answered their heartbeat."""
    idle: bool
    """Every actor answered and none is in a call: the wait is for arguments another actor
    computes (e.g. a weight push from the trainer), and that actor is the one to judge."""


def judge(beats: dict[str, Beat], limit: float) -> Verdict:
    """The :class:`Verdict` of the heartbeats ``beats`` (``{actor: beat}``) at ``limit``."""
    stuck = tuple(i for i, beat in beats.items() if is_stuck(beat, limit))
    answered = frozenset(i for i, beat in beats.items() if beat is not None)
    idle = not stuck and not any(beat[0] for beat in beats.values() if beat is not None)
    return Verdict(stuck, answered, idle)


@dataclass(frozen=True)
class ServerFindings:
    """What the rollout workers found asking their SGLang servers' ``/health_generate``."""

    killed: list[dict]
    """``{worker, pool, index, url, pid}`` of each server that gave no 200 (killed)."""
    serving: frozenset[str]
    """The workers whose every server answered: their call waits on servers that move."""


def read_server_answers(ids: list[str], answers: list[dict | None]) -> ServerFindings:
    """The :class:`ServerFindings` of the workers ``ids``' answers (``None``: no answer)."""
    answers = [a or {"killed": [], "answered": 0} for a in answers]
    killed = [dict(server, worker=i) for i, a in zip(ids, answers, strict=True)
              for server in a["killed"]]  # fmt: skip
    serving = frozenset(
        i for i, a in zip(ids, answers, strict=True) if a["answered"] and not a["killed"]
    )
    return ServerFindings(killed, serving)


class StuckCallError(TimeoutError):
    """A call past its deadline whose actor showed no progress; ``actor_id`` names the actor
    (hex, as ``RayActorError.actor_id``; ``None``: not an actor's call)."""

    def __init__(self, message: str, actor_id: str | None, actor_kind: str):
        super().__init__(message)
        self.actor_id, self.actor_kind = actor_id, actor_kind


class StuckServerError(StuckCallError):
    """A call past its deadline while an SGLang server of the run no longer answered (its
    ``/health_generate`` gave no 200 within :data:`SERVER_PROBE_S`); the server was killed.
    ``servers``: ``{worker, pool, index, url, pid}`` of each; ``pending``: the refs of the
    waited-for calls, which fail on the killed servers. ``recovery.py`` restarts the servers
    with the current weights and does the call again; where nothing does, it is the stuck
    rollout worker it names."""

    def __init__(self, message: str, actor_id: str | None, servers: list[dict], pending: list):
        super().__init__(message, actor_id, "rollout")
        self.servers, self.pending = servers, pending

    def settle(self, timeout_s: float = 60.0) -> None:
        """Wait (bounded) for the calls that waited on the killed servers and drop their
        errors: they end once their requests fail, before the workers run the heal, and an
        error nobody reads would be printed as Ray's "Unhandled error"."""
        import ray

        if not self.pending:
            return
        ray.wait(self.pending, num_returns=len(self.pending), timeout=timeout_s)
        for ref in self.pending:
            try:
                ray.get(ref, timeout=0)
            except Exception:  # noqa: BLE001 - the expected failure of a call on a killed server
                pass


class StopDuringCallError(RequeueError):
    """A stop signal came and a call did not finish within ``orchestration.stop_wait_s``."""


@dataclass
class ActorEntry:
    """What the driver knows of one actor: its handle, class, and (once asked) node and pid."""

    handle: object
    cls: str
    index: int = -1
    node_id: str = ""
    ip: str = ""
    pid: int = 0

    def name(self) -> str:
        """``RolloutWorker 0 (pid 1234 on 10.0.0.2)``."""
        index = f" {self.index}" if self.index >= 0 else ""
        where = f" (pid {self.pid} on {self.ip or self.node_id})" if self.pid else ""
        return f"{self.cls}{index}{where}"


@dataclass(frozen=True)
class Wait:
    """One bounded wait: its kind, the caller's description (for messages only), its start
    and its deadline in seconds."""

    kind: CallKind
    what: str
    start: float
    limit: float


class CallWatch:
    """The run's deadlines, actors and stop signal, for every bounded wait of the driver.

    Lifecycle: ``loop.train`` makes one per run before anything starts, with the run's
    ``orchestration`` settings (defaults when ``None``), its stop signal and run directory,
    and the session hands it to what waits on actors: the actor handles (each actor is
    registered as it starts, :func:`start_actor`, and forgotten when it is closed, killed or
    replaced), the weight sync, the recovery, the host-memory watch and the rollout thread.
    It learns every kind's durations for the whole run; :meth:`pop_metrics` takes its fault
    counts once a step. It runs no thread or process of its own: nothing to stop."""

    def __init__(self, orchestration=None, stop=None, run_dir: str | Path = "") -> None:
        o = orchestration
        self.rule = DeadlineRule() if o is None else DeadlineRule(
            o.call_deadline_multiple, o.call_deadline_quantile, o.call_deadline_floor_s,
            o.call_deadline_cap_s)  # fmt: skip
        self.stop_wait_s = 60.0 if o is None else o.stop_wait_s
        self.stop, self.run_dir = stop, Path(run_dir)
        self.actors: dict[str, ActorEntry] = {}
        self.stuck: dict[str, float] = {}  # faults/stuck_<actor kind> since the last pop
        self.killed_stuck: set[str] = set()  # actors killed as stuck (their other calls die)
        self.logged: dict[CallKind, float] = {}

    def cap(self) -> float:
        cap = env_cap()
        return self.rule.cap_s if cap is None else min(cap, self.rule.cap_s)

    def announce(self) -> None:
        """The rule in the run log, once at the start."""
        r = self.rule
        print(f"call deadlines: {r.multiple:g} x p{r.q * 100:g} of each call kind's last "
              f"{HISTORY} durations per unit of work, within [{r.floor_s:g}s, "
              f"{self.cap():g}s]; a kind's first call waits {self.cap():g}s", flush=True)  # fmt: skip

    # ------------------------------------------------------------------ actors
    def register(self, handle, cls: str) -> None:
        self.actors[handle._actor_id.hex()] = ActorEntry(handle, cls)

    def locate_actor(self, handle, info: dict, index: int = -1) -> None:
        """Where ``handle``'s process runs (its ``node_info``); ``index``: its place among
        the workers of its class."""
        entry = self.actors.get(handle._actor_id.hex())
        if entry is not None:
            entry.node_id, entry.ip, entry.pid = info["node_id"], info["ip"], info["pid"]
            entry.index = index

    def forget(self, handle) -> None:
        """``handle``'s actor is gone (replaced, killed, closed): never asked again."""
        self.actors.pop(handle._actor_id.hex(), None)

    # ------------------------------------------------------------------ waits
    def get(self, refs, kind: CallKind, what: str, timeout: float | None = None,
            work: float = 1.0):  # fmt: skip
        """``ray.get(refs)`` within the deadline of ``kind`` for ``work`` units (``timeout``: a
        fixed one); ``what`` describes the call in messages. Raises :class:`StuckCallError`
        or :class:`StopDuringCallError`."""
        import ray

        if not isinstance(kind, CallKind):
            raise TypeError(f"the kind of {what!r} must be a CallKind, not {kind!r}")
        many = isinstance(refs, list | tuple)
        pending = list(dict.fromkeys(refs)) if many else [refs]
        limit = timeout if timeout is not None else min(self.rule.deadline(kind, work), self.cap())
        call = Wait(kind, what, time.monotonic(), limit)
        deadline = call.start + limit
        while pending:
            self.check_stop(what, call.start)
            left = max(deadline - time.monotonic(), 0.0)
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(POLL_S, left))
            if pending and time.monotonic() >= deadline:
                self.past_deadline(pending, call, fixed=timeout is not None)
                deadline = time.monotonic() + limit  # slow but moving: another deadline
        values = ray.get(refs)
        if timeout is None:
            self.learn(kind, time.monotonic() - call.start, work)
        return values

    def past_deadline(self, pending: list, call: Wait, fixed: bool) -> None:
        """``pending`` of ``call`` past its deadline: raise for a stuck actor or server (killed
        first); return when every one behind it moves (or, for plain tasks, which have no
        heartbeat, before the fixed bound or the cap)."""
        waited = time.monotonic() - call.start
        if not self.actors_of(pending):
            if fixed or waited >= self.cap():
                raise self.stuck_error([], call, waited)
            return
        verdict = self.culprits(pending, call.limit)
        servers = self.probe_servers(verdict)
        if servers.killed:  # the call waits on a server, not on the worker
            raise self.server_error(servers.killed, call, waited, pending)
        if verdict.stuck and not set(verdict.stuck) <= servers.serving:
            raise self.stuck_error(list(verdict.stuck), call, waited)

    def check_stop(self, what: str, start: float) -> None:
        advance()  # the driver's main loop polls: progress for its parent (cli/driver_watch.py)
        stop = self.stop
        if stop is None or not stop.received:
            return
        since = max(stop.received_at, start)
        if time.monotonic() - since > self.stop_wait_s:
            raise StopDuringCallError(
                f"{stop.name} arrived and {what} did not finish within orchestration."
                f"stop_wait_s={self.stop_wait_s:g}s: exiting {EXIT_REQUEUE} without it. Newest "
                f"complete checkpoint: {newest_checkpoint_text(self.run_dir)}; `armor train "
                f"CONFIG --resume auto` continues from it"
            )

    def learn(self, kind: CallKind, seconds: float, work: float) -> None:
        """Keep the duration; log the deadline of a ``logged`` kind when it is new or moved."""
        self.rule.observe(kind, seconds, work)
        if not kind.logged:
            return
        now = self.rule.deadline(kind, work)
        before = self.logged.get(kind)
        if before is None or not before / CHANGE_LOGGED <= now <= before * CHANGE_LOGGED:
            self.logged[kind] = now
            print(f"call deadline: {kind.label} {now:.0f}s (for {work:g} unit(s) of work)",
                  flush=True)  # fmt: skip

    # ------------------------------------------------------------------ verdicts
    def actors_of(self, refs: list) -> list[str]:
        """The ids of the actors running ``refs`` (hex; refs of no known actor left out)."""
        ids = [ref.task_id().actor_id().hex() for ref in refs]
        return [i for i in dict.fromkeys(ids) if i in self.actors]

    def culprits(self, refs: list, limit: float) -> Verdict:
        """The :class:`Verdict` on the actors behind ``refs`` past their deadline; when every
        one of them is idle (:attr:`Verdict.idle`), the verdict on every other actor of the run
        instead (the one that computes what they wait for)."""
        ids = self.actors_of(refs)
        verdict = judge(self.heartbeats(ids), limit)
        if not verdict.idle:
            return verdict
        others = judge(self.heartbeats([i for i in self.actors if i not in ids]), limit)
        return Verdict(others.stuck, verdict.answered | others.answered, others.idle)

    def heartbeats(self, ids: list[str]) -> dict[str, Beat]:
        """The :data:`Beat` of each actor (``None`` for one that did not answer within
        :data:`HEARTBEAT_ANSWER_S`). Asked by a task of its own: Ray runs one caller's calls to
        an actor in the order sent, so the driver's own heartbeat call would wait behind its
        call that waits for its arguments. A probe that does not come back (Ray itself
        overloaded) blames no one: every actor counts as moving."""
        import ray

        if not ids:
            return {}
        probe = ray.remote(num_cpus=0)(probe_heartbeats)
        ref = probe.remote([self.actors[i].handle for i in ids], HEARTBEAT_ANSWER_S)
        try:
            answers = ray.get(ref, timeout=PROBE_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - no verdict without answers
            print(f"warning: the heartbeat probe failed ({type(err).__name__}); waiting on",
                  flush=True)  # fmt: skip
            return {i: (True, 0.0) for i in ids}
        return dict(zip(ids, answers, strict=True))

    def probe_servers(self, verdict: Verdict) -> ServerFindings:
        """The stuck rollout workers of ``verdict`` that answered their heartbeat (alive, in a
        call without progress: one that did not answer cannot ask its servers) ask their
        SGLang servers' ``/health_generate`` and kill those without a 200 (their
        ``kill_wedged_servers``). Only a stuck worker's servers are asked: a server busy in a
        weight update for a stuck trainer rank would not answer, and the trainer is the one
        to name."""
        import ray

        ids = [i for i in verdict.stuck
               if self.actors[i].cls == "RolloutWorker" and i in verdict.answered]  # fmt: skip
        if not ids:
            return ServerFindings([], frozenset())
        probe = ray.remote(num_cpus=0)(probe_servers)
        ref = probe.remote([self.actors[i].handle for i in ids], SERVER_PROBE_S)
        try:
            answers = ray.get(ref, timeout=PROBE_TIMEOUT_S + SERVER_PROBE_S)
        except Exception as err:  # noqa: BLE001 - then the workers are the ones blamed
            print(f"warning: the SGLang server probe failed ({type(err).__name__})", flush=True)
            return ServerFindings([], frozenset())
        found = read_server_answers(ids, answers)
        if found.serving and not found.killed:
            names = ", ".join(self.actors[i].name() for i in sorted(found.serving))
            print(f"call deadline: the SGLang servers of {names} answer /health_generate "
                  "(busy and moving): waiting on", flush=True)  # fmt: skip
        return found

    # ------------------------------------------------------------------ the stuck
    def server_error(self, servers: list[dict], call: Wait, waited: float,
                     pending: list) -> StuckServerError:  # fmt: skip
        """Name the killed servers (URL, pid, worker, the call, how long), count them."""
        named = "; ".join(
            f"SGLang {x['pool']} server {x['index']} at {x['url']} (pid {x['pid']}, "
            f"{self.actors[x['worker']].name()})" for x in servers
        )  # fmt: skip
        message = (f"{named} did not answer /health_generate within {SERVER_PROBE_S:g}s: "
                   f"{call.what} ({call.kind.label}) waited {waited:.0f}s, past its deadline of "
                   f"{call.limit:.0f}s, with no progress")  # fmt: skip
        print(f"stuck call: {message}; killed, restarting with the current weights", flush=True)
        key = "faults/stuck_sglang_server"
        self.stuck[key] = self.stuck.get(key, 0.0) + len(servers)
        return StuckServerError(message, servers[0]["worker"], servers, pending)

    def stuck_error(self, silent: list[str], call: Wait, waited: float) -> StuckCallError:
        """Name the first silent actor, kill it and its processes, count it."""
        entry = self.actors.get(silent[0]) if silent else None
        actor_kind = ACTOR_KINDS.get(entry.cls, "unknown") if entry else "unknown"
        who = entry.name() if entry else "a Ray process"
        message = (f"{who} is stuck: {call.what} ({call.kind.label}) waited {waited:.0f}s, past "
                   f"its deadline of {call.limit:.0f}s, with no progress from it")  # fmt: skip
        print(f"stuck call: {message}; killing it", flush=True)
        if entry is not None:
            self.killed_stuck.add(silent[0])
            self.kill(entry)
        key = f"faults/stuck_{actor_kind}"
        self.stuck[key] = self.stuck.get(key, 0.0) + 1.0
        return StuckCallError(message, silent[0] if silent else None, actor_kind)

    def kill(self, entry: ActorEntry) -> None:
        """SIGKILL of ``entry``'s process and everything it started (``ray.kill`` does not end
        a stopped process): here when it runs on the driver's node, else by a task pinned to
        its node."""
        import ray

        if entry.pid:  # first: its children are found through it
            kill_on_node(entry.node_id, [entry.pid])
        try:
            ray.kill(entry.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - dead already
            pass
        self.forget(entry.handle)

    def killed_as_stuck(self, actor_id: str | None) -> bool:
        """Whether the actor ``actor_id`` was killed past a deadline (its other calls die)."""
        return actor_id in self.killed_stuck

    def pop_metrics(self) -> dict[str, float]:
        """``faults/stuck_<trainer|rollout|reward|unknown>`` since the last call (only those
        that happened)."""
        out, self.stuck = self.stuck, {}
        return out


def probe_heartbeats(handles: list, timeout_s: float) -> list[Beat]:
    """In a Ray task: each actor's ``heartbeat()`` (``None``: no answer in ``timeout_s``)."""
    import ray

    asks = [h.heartbeat.remote() for h in handles]
    ready, _ = ray.wait(asks, num_returns=len(asks), timeout=timeout_s)
    answered = {r.hex() for r in ready}
    out: list[Beat] = []
    for ask in asks:
        try:
            out.append(tuple(ray.get(ask)) if ask.hex() in answered else None)
        except Exception:  # noqa: BLE001 - a dead actor: its own call fails
            out.append(None)
    return out


def probe_servers(handles: list, timeout_s: float) -> list[dict | None]:
    """In a Ray task: each rollout worker's ``kill_wedged_servers`` (``None``: no answer)."""
    import ray

    asks = [h.kill_wedged_servers.remote(timeout_s) for h in handles]
    ready, _ = ray.wait(asks, num_returns=len(asks), timeout=timeout_s + HEARTBEAT_ANSWER_S * 2)
    answered = {r.hex() for r in ready}
    out: list[dict | None] = []
    for ask in asks:
        try:
            out.append(ray.get(ask) if ask.hex() in answered else None)
        except Exception:  # noqa: BLE001 - a dead worker: its own call fails
            out.append(None)
    return out


def start_actor(watch: CallWatch, cls, options: dict, *args):
    """A Ray actor of ``cls`` (a :class:`Watched` worker) with ``options``, registered with
    ``watch``."""
    import ray

    actor = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(cls).options(**options).remote(*args)
    watch.register(actor, cls.__name__)
    return actor
