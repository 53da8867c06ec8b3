"""Deadlines the run learns for its calls to the actors, and what happens past them
(docs/orchestration.md, "Stuck calls").

Every wait on an actor (``actor_handles.wait``) goes through :data:`WATCH`. A call's *kind*
(generate, score, log-probs, updates, weight push, reset, validation, checkpoint; any other
call is its own kind) has a deadline from its own recent durations (:class:`DeadlineRule`):
``call_deadline_multiple`` x the ``call_deadline_quantile`` of the last :data:`HISTORY`
durations per unit of work, x the work of this call, within ``call_deadline_floor_s`` and
``call_deadline_cap_s`` (and ``ARMOR_CALL_TIMEOUT_S`` when set); a kind's first call waits
for the cap. At the deadline the driver asks each actor that has not answered for its
heartbeat (``heartbeat.py``, answered from a thread of its own: the actors run
a concurrency group :data:`WATCH_GROUP`); one that made progress within the deadline gets
the deadline again. One that did not is *stuck*: it is named (class, node, pid, the call,
how long it waited), its process and the processes it started are killed, and
:class:`StuckCallError` (a ``TimeoutError`` naming the actor) is handled like a dead actor
(``recovery.py``: a rollout or reward worker replaced, anything else exit 75). Before a rollout worker
that answers its heartbeat is called stuck, it asks its SGLang servers'
``/health_generate``: a server without a 200 is the one stuck (killed by its worker,
:class:`StuckServerError`: ``recovery.py`` restarts it with the current weights and does the
phase again); a worker whose servers all answer waits on servers that move (another deadline).

After a stop signal (``run_state.StopSignal``) no wait lasts past ``orchestration.stop_wait_s``
from the signal: :class:`StopDuringCallError` ends the run with exit 75 on the newest complete
checkpoint without waiting for the call, within Slurm's signal lead.
"""

from __future__ import annotations

import os
import signal
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from megatron_armor import env_settings
from megatron_armor.heartbeat import (
    busy,
    call_ended,
    call_started,
    seconds_since_beat,
)
from megatron_armor.orchestration.actors.faults import RequeueError, newest_checkpoint_text
from megatron_armor.orchestration.run.run_state import EXIT_REQUEUE
from megatron_armor.supervisor_pipe import advance

WATCH_GROUP = "watch"
CONCURRENCY_GROUPS = {WATCH_GROUP: 1}
HISTORY = 20  # durations kept per kind
POLL_S = 1.0  # how often a wait looks at the stop signal
HEARTBEAT_ANSWER_S = 5.0  # how long an actor gets to answer its heartbeat call
PROBE_TIMEOUT_S = 60.0  # the task that asks them (its worker may have to start)
SERVER_PROBE_S = 30.0  # /health_generate: SGLang answers 503 after 20 s of a silent scheduler
CHANGE_LOGGED = 1.25  # a kind's deadline is logged again when it moves by this factor
KIND_WORDS = (  # (words in a wait's description, kind): first match wins
    ("generate_raw", "validation"), ("generate", "generate"), ("sample_reference", "generate"),
    ("scoring", "score"), ("log-probs", "logprobs"), ("train step", "updates"),
    ("weight", "weight_push"), ("reset", "reset"), ("checkpoint", "checkpoint"),
    ("rollout state", "checkpoint"),
)  # fmt: skip
ACTOR_KINDS = {"TrainerWorker": "trainer", "RolloutWorker": "rollout", "RewardWorker": "reward"}


def kind_of(what: str) -> str:
    """The call kind of a wait described as ``what`` (``"rollout generate"`` -> ``generate``);
    a description of no kind is its own kind."""
    return next((kind for words, kind in KIND_WORDS if words in what), what)


def env_cap() -> float | None:
    """``ARMOR_CALL_TIMEOUT_S`` when set: a cap on every deadline."""
    return env_settings.value("ARMOR_CALL_TIMEOUT_S")


def quantile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (linear between the two nearest ranks)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("quantile of no values")
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass
class DeadlineRule:
    """Per call kind: the deadline of a call given ``work`` units, learned from the kind's
    last :data:`HISTORY` durations per unit (``multiple`` x their ``q`` quantile x ``work``,
    within ``[floor_s, cap_s]``; ``cap_s`` before the kind's first call finished)."""

    multiple: float = 10.0
    q: float = 0.9
    floor_s: float = 30.0
    cap_s: float = 3600.0
    history: dict[str, deque] = field(default_factory=dict)

    def deadline(self, kind: str, work: float = 1.0) -> float:
        seen = self.history.get(kind)
        if not seen:
            return self.cap_s
        learned = self.multiple * quantile(seen, self.q) * max(work, 1e-9)
        return min(max(learned, self.floor_s), self.cap_s)

    def observe(self, kind: str, seconds: float, work: float = 1.0) -> None:
        """A call of ``kind`` with ``work`` units took ``seconds``."""
        self.history.setdefault(kind, deque(maxlen=HISTORY)).append(seconds / max(work, 1e-9))


class StuckCallError(TimeoutError):
    """A call past its deadline whose actor showed no progress; ``actor_id`` names the actor
    (hex, as ``RayActorError.actor_id``; ``None``: not an actor's call)."""

    def __init__(self, message: str, actor_id: str | None, actor_kind: str):
        super().__init__(message)
        self.actor_id, self.actor_kind = actor_id, actor_kind


class StuckServerError(StuckCallError):
    """A call past its deadline while an SGLang server of the run no longer answered (its
    ``/health_generate`` gave no 200 within :data:`SERVER_PROBE_S`); the server was killed.
    ``servers``: ``{worker, pool, index, url, pid}`` of each. ``recovery.py`` restarts them with
    the current weights and does the call again; where nothing does, it is the stuck rollout
    worker it names."""

    def __init__(self, message: str, actor_id: str | None, servers: list[dict]):
        super().__init__(message, actor_id, "rollout")
        self.servers = servers
        self.pending: list = []  # the waited-for calls, failing on the killed servers

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


class CallWatch:
    """The run's deadlines, actors and stop signal, for every bounded wait of the driver."""

    def __init__(self) -> None:
        self.configure()
        self.actors: dict[str, ActorEntry] = {}
        self.stuck: dict[str, float] = {}  # faults/stuck_<actor kind> since the last pop
        self.answered: set[str] = set()  # actors that answered the last deadline's probes
        self.killed_stuck: set[str] = set()  # actors killed as stuck (their other calls die)
        self.logged: dict[str, float] = {}

    def configure(self, orchestration=None, stop=None, run_dir: str | Path = "") -> None:
        """The settings of ``orchestration`` (``OrchestrationConfig``; defaults when None), the
        run's ``stop`` signal and run directory; the learned durations start over."""
        o = orchestration
        self.rule = DeadlineRule() if o is None else DeadlineRule(
            o.call_deadline_multiple, o.call_deadline_quantile, o.call_deadline_floor_s,
            o.call_deadline_cap_s)  # fmt: skip
        self.stop_wait_s = 60.0 if o is None else o.stop_wait_s
        self.stop, self.run_dir = stop, Path(run_dir)
        self.logged = {}

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

    # ------------------------------------------------------------------ waits
    def get(self, refs, what: str, timeout: float | None = None, work: float = 1.0):
        """``ray.get(refs)`` within the deadline of ``what``'s kind (``timeout``: a fixed one);
        raises :class:`StuckCallError` or :class:`StopDuringCallError`."""
        import ray

        many = isinstance(refs, list | tuple)
        pending = list(dict.fromkeys(refs)) if many else [refs]
        kind = kind_of(what)
        limit = timeout if timeout is not None else self.rule.deadline(kind, work)
        limit = min(limit, self.cap()) if timeout is None else limit
        start = time.monotonic()
        deadline = start + limit
        while pending:
            self.check_stop(what, start)
            left = max(deadline - time.monotonic(), 0.0)
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(POLL_S, left))
            now = time.monotonic()
            if pending and now >= deadline:
                if self.actors_of(pending):
                    stuck = self.culprits(pending, limit)
                    servers, serving = self.kill_wedged_servers(stuck)
                    if servers:  # the call waits on a server, not on the worker
                        err = self.server_error(servers, what, kind, now - start, limit)
                        err.pending = pending  # its calls fail now; the recovery reads them
                        raise err
                    if stuck and not set(stuck) <= serving:
                        raise self.stuck_error(stuck, what, kind, now - start, limit)
                elif timeout is not None or now - start >= self.cap():
                    # tasks (no heartbeat to ask): the fixed bound or the cap only
                    raise self.stuck_error([], what, kind, now - start, limit)
                deadline = time.monotonic() + limit  # slow but moving: another deadline
        values = ray.get(refs)
        if timeout is None:
            self.learn(kind, time.monotonic() - start, work)
        return values

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

    def learn(self, kind: str, seconds: float, work: float) -> None:
        """Keep the duration; log the kind's deadline when it is new or moved."""
        self.rule.observe(kind, seconds, work)
        if kind not in {k for _, k in KIND_WORDS}:
            return
        now = self.rule.deadline(kind, work)
        before = self.logged.get(kind)
        if before is None or not before / CHANGE_LOGGED <= now <= before * CHANGE_LOGGED:
            self.logged[kind] = now
            print(f"call deadline: {kind} {now:.0f}s (for {work:g} unit(s) of work)", flush=True)

    def actors_of(self, refs: list) -> list[str]:
        """The ids of the actors running ``refs`` (hex; refs of no known actor left out)."""
        ids = [ref.task_id().actor_id().hex() for ref in refs]
        return [i for i in dict.fromkeys(ids) if i in self.actors]

    def culprits(self, refs: list, limit: float) -> list[str]:
        """The stuck actors behind ``refs`` past their deadline: those of ``refs`` that do not
        answer or are in a call without progress for ``limit`` seconds; when every one of them
        is idle (its call waits for arguments another actor is computing, e.g. a weight push
        from the trainer), any other actor of the run that is stuck so. Empty: all moving."""
        ids = self.actors_of(refs)
        self.answered = set()
        states = self.heartbeats(ids)
        stuck = [i for i in ids if is_stuck(states[i], limit)]
        if stuck or any(states[i] is not None and states[i][0] for i in ids):
            return stuck
        others = [i for i in self.actors if i not in ids]
        states = self.heartbeats(others)
        return [i for i in others if is_stuck(states[i], limit)]

    def heartbeats(self, ids: list[str]) -> dict[str, tuple[bool, float] | None]:
        """``(busy, seconds since progress)`` of each actor, ``None`` for one that did not
        answer within :data:`HEARTBEAT_ANSWER_S`. Asked by a task of its own: Ray runs one
        caller's calls to an actor in the order sent, so the driver's own heartbeat call would
        wait behind its call that waits for its arguments. A probe that does not come back
        (Ray itself overloaded) blames no one: every actor counts as moving."""
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
        self.answered |= {i for i, a in zip(ids, answers, strict=True) if a is not None}
        return dict(zip(ids, answers, strict=True))

    def kill_wedged_servers(self, stuck: list[str]) -> tuple[list[dict], set[str]]:
        """The SGLang servers of the ``stuck`` rollout workers that answered their heartbeat
        (alive, in a call without progress: one that did not answer cannot ask its servers)
        which do not answer their ``/health_generate``, killed by their workers; and the
        workers whose every server answered (their call waits on servers that make progress:
        slow, not stuck). Only a stuck worker's servers are asked: a server busy in a weight
        update for a stuck trainer rank would not answer, and the trainer is the one to name."""
        import ray

        ids = [i for i in stuck if self.actors[i].cls == "RolloutWorker" and i in self.answered]
        if not ids:
            return [], set()
        probe = ray.remote(num_cpus=0)(probe_servers)
        ref = probe.remote([self.actors[i].handle for i in ids], SERVER_PROBE_S)
        try:
            answers = ray.get(ref, timeout=PROBE_TIMEOUT_S + SERVER_PROBE_S)
        except Exception as err:  # noqa: BLE001 - then the workers are blamed, as before
            print(f"warning: the SGLang server probe failed ({type(err).__name__})", flush=True)
            return [], set()
        answers = [a or {"killed": [], "answered": 0} for a in answers]
        killed = [dict(server, worker=i) for i, a in zip(ids, answers, strict=True)
                  for server in a["killed"]]  # fmt: skip
        serving = {
            i for i, a in zip(ids, answers, strict=True) if a["answered"] and not a["killed"]
        }
        if serving and not killed:
            names = ", ".join(self.actors[i].name() for i in sorted(serving))
            print(f"call deadline: the SGLang servers of {names} answer /health_generate "
                  "(busy and moving): waiting on", flush=True)  # fmt: skip
        return killed, serving

    def server_error(self, servers: list[dict], what: str, kind: str, waited: float,
                     limit: float) -> StuckServerError:  # fmt: skip
        """Name the killed servers (URL, pid, worker, the call, how long), count them."""
        named = "; ".join(
            f"SGLang {x['pool']} server {x['index']} at {x['url']} (pid {x['pid']}, "
            f"{self.actors[x['worker']].name()})" for x in servers
        )  # fmt: skip
        message = (f"{named} did not answer /health_generate within {SERVER_PROBE_S:g}s: "
                   f"{what} ({kind}) waited {waited:.0f}s, past its deadline of {limit:.0f}s, "
                   "with no progress")  # fmt: skip
        print(f"stuck call: {message}; killed, restarting with the current weights", flush=True)
        key = "faults/stuck_sglang_server"
        self.stuck[key] = self.stuck.get(key, 0.0) + len(servers)
        return StuckServerError(message, servers[0]["worker"], servers)

    def forget(self, handle) -> None:
        """``handle``'s actor is gone (replaced, killed, closed): never asked again."""
        self.actors.pop(handle._actor_id.hex(), None)

    def stuck_error(self, silent: list[str], what: str, kind: str, waited: float,
                    limit: float) -> StuckCallError:  # fmt: skip
        """Name the first silent actor, kill it and its processes, count it."""
        entry = self.actors.get(silent[0]) if silent else None
        actor_kind = ACTOR_KINDS.get(entry.cls, "unknown") if entry else "unknown"
        who = entry.name() if entry else "a Ray process"
        message = (f"{who} is stuck: {what} ({kind}) waited {waited:.0f}s, past its deadline "
                   f"of {limit:.0f}s, with no progress from it")  # fmt: skip
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

    def pop_metrics(self) -> dict[str, float]:
        """``faults/stuck_<trainer|rollout|reward|unknown>`` since the last call (only those
        that happened)."""
        out, self.stuck = self.stuck, {}
        return out


WATCH = CallWatch()


def probe_heartbeats(handles: list, timeout_s: float) -> list[tuple[bool, float] | None]:
    """In a Ray task: each actor's ``heartbeat()`` (``None``: no answer in ``timeout_s``)."""
    import ray

    asks = [h.heartbeat.remote() for h in handles]
    ready, _ = ray.wait(asks, num_returns=len(asks), timeout=timeout_s)
    answered = {r.hex() for r in ready}
    out: list[tuple[bool, float] | None] = []
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


def is_stuck(state: tuple[bool, float] | None, limit: float) -> bool:
    """A heartbeat that did not come, or a call under way without progress for ``limit``."""
    return state is None or (state[0] and state[1] > limit)


def start_actor(cls, options: dict, *args):
    """A Ray actor of ``cls`` (a :class:`Watched` worker) with ``options``, registered with
    :data:`WATCH`."""
    import ray

    actor = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(cls).options(**options).remote(*args)
    WATCH.register(actor, cls.__name__)
    return actor


class Watched:
    """The heartbeat of a worker class (:class:`CallWatch` asks it past a deadline). Its
    actors are made with :func:`start_actor`: Ray refuses an actor class whose method names a
    concurrency group the actor was not given."""

    def heartbeat(self) -> tuple[bool, float]:
        """Whether a call is under way here, and the seconds since this process last made
        progress."""
        return busy(), seconds_since_beat()

    # what ray.method(concurrency_group=...) sets, without importing Ray here
    heartbeat.__ray_concurrency_group__ = WATCH_GROUP


def beating(cls):
    """Class decorator: every public method of ``cls`` beats when it starts and when it ends
    (a queue of short calls is progress too)."""
    import functools
    import inspect

    def wrap(method):
        @functools.wraps(method)
        def call(*args, **kwargs):
            call_started()
            try:
                return method(*args, **kwargs)
            finally:
                call_ended()

        return call

    for name, value in list(vars(cls).items()):
        watch = getattr(value, "__ray_concurrency_group__", None) == WATCH_GROUP
        if inspect.isfunction(value) and not name.startswith("_") and not watch:
            setattr(cls, name, wrap(value))
    return cls


# ---------------------------------------------------------------------- process trees
def children_of() -> dict[int, list[int]]:
    """``{pid: [child pids]}`` of every process on this node (from /proc)."""
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        out.setdefault(ppid, []).append(int(entry.name))
    return out


def process_trees(roots: list[int]) -> list[int]:
    """``roots`` and all their descendants (a root first, then its children)."""
    children, out, todo = children_of(), [], list(roots)
    while todo:
        pid = todo.pop(0)
        if pid not in out:
            out.append(pid)
            todo += children.get(pid, [])
    return out


def kill_trees(roots: list[int]) -> list[int]:
    """SIGKILL ``roots`` and their descendants, found before any is killed (orphans are
    re-parented and could not be found after); returns the pids signalled."""
    pids = [p for p in process_trees(roots) if p != os.getpid()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return pids


def kill_on_node(node_id: str, roots: list[int]) -> None:
    """:func:`kill_trees` of ``roots`` on Ray node ``node_id``: here on the driver's node, else
    by a task pinned there (bounded; best effort: a lost node took them already)."""
    import ray

    if not roots:
        return
    if node_id == ray.get_runtime_context().get_node_id():
        kill_trees(roots)
        return
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    strategy = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    task = ray.remote(num_cpus=0)(kill_trees).options(scheduling_strategy=strategy)
    try:
        ray.get(task.remote(roots), timeout=HEARTBEAT_ANSWER_S * 2)
    except Exception as err:  # noqa: BLE001 - report, the run ends or goes on without it
        print(f"warning: could not kill {roots} on node {node_id}: {err}", flush=True)
