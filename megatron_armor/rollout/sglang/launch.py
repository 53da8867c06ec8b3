"""Build, start and wait for ``sglang.launch_server`` and ``sglang_router.launch_router``.

Command-line flags are ``--`` + the ``ServerArgs`` field name with ``_`` -> ``-`` (SGLang's
``ServerArgs.add_cli_args`` convention); booleans are ``store_true`` flags, lists are
``nargs='+'``. When SGLang is importable every key is checked against the fields of
``sglang.srt.server_args.ServerArgs`` before anything starts; ``tests/unit/test_sglang_contract.py``
checks the generated flags against the pinned SGLang wheel's command line.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from megatron_armor.config.model_overrides import read_hf_config, resolve_model_overrides
from megatron_armor.with_parent import command_with_parent

ROUTER_POLICIES = ("random", "round_robin", "cache_aware", "power_of_two")
# SGLang returns log_softmax(logits / T) for sampled tokens unless this is true; the trainer
# computes log_softmax(logits / T), so the servers are started with it off.
LOGPROB_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "false"}
SERVER_ENV_UNSET = ("CUDA_DEVICE_MAX_CONNECTIONS",)
"""Variables a server must not inherit: ``CUDA_DEVICE_MAX_CONNECTIONS=1`` is for Megatron's
TP/SP communication overlap on the trainer ranks (``slurm/env/h100-ib.sh`` exports it for the
whole job); in a server it puts every CUDA stream on one hardware queue, serialising SGLang's
overlapped scheduling."""

# Servers on a machine without GPUs (``orchestration.layout: cpu``): the sglang test tier and
# CPU-only experiments. Every CPU-only addition is here; ``rollout.sglang.extra_args`` overrides
# each. SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE``) with torch's own attention and sampling
# (no CUDA graphs); fp32, as the CPU trainer computes; a KV pool of 4096 tokens (SGLang's default
# sizing would take ~70% of the host's memory); no warm-up request; an idle scheduler sleeps on
# its sockets instead of polling a core; every server on NUMA node 0 (the CPU engine reads the
# GPU id as the NUMA node whose cores its threads bind to: a second server would ask for node 1
# of a one-node host). SGLang 0.5.23's wheel needs start-up guards to get this far without a
# CUDA driver; the sglang test tier installs them in its own virtualenv (docs/gpu.md).
CPU_SERVER_ARGS: dict[str, Any] = {
    "device": "cpu",
    "attention_backend": "torch_native",
    "sampling_backend": "pytorch",
    "disable_cuda_graph": True,
    "dtype": "float32",
    "max_total_tokens": 4096,
    "skip_server_warmup": True,
    "sleep_on_idle": True,
    "base_gpu_id": 0,
}
CPU_SERVER_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}


def server_env(on_cpu: bool = False) -> dict[str, str | None]:
    """Environment changes of a server process (``None``: removed from the inherited one)."""
    env: dict[str, str | None] = {**LOGPROB_ENV, **{k: None for k in SERVER_ENV_UNSET}}
    return env | (CPU_SERVER_ENV if on_cpu else {})


def server_arg_fields() -> set[str] | None:
    """Field names of SGLang's ``ServerArgs``, or ``None`` when SGLang is absent."""
    try:
        from sglang.srt.server_args import ServerArgs
    except ImportError:
        return None
    return record_field_names(ServerArgs)


def record_field_names(cls: type) -> set[str]:
    """Field names of a dataclass or a ``msgspec.Struct`` (``ServerArgs`` is a dataclass up to
    SGLang 0.5.x's middle releases and a ``msgspec`` struct assembled from namespaces after)."""
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(cls.__struct_fields__)


def validate_server_args(args: dict[str, Any], known_fields: Iterable[str]) -> None:
    """Raise when a key of ``args`` is not a ``ServerArgs`` field."""
    known = set(known_fields)
    unknown = sorted(k for k in args if k not in known)
    if unknown:
        raise ValueError(
            f"rollout.sglang.extra_args has keys {unknown} that are not fields of SGLang's "
            "ServerArgs (sglang.srt.server_args); use ServerArgs field names such as "
            "'max_running_requests' or 'chunked_prefill_size'"
        )


def server_args_for(
    model_path: str,
    port: int,
    *,
    tp: int = 1,
    mem_fraction_static: float = 0.7,
    host: str = "127.0.0.1",
    base_gpu_id: int = 0,
    colocated: bool = False,
    extra_args: dict[str, Any] | None = None,
    api_key: str = "",
    context_length: int = 0,
    model_overrides: dict[str, Any] | None = None,
    on_cpu: bool = False,
    weights_cpu_backup: bool = False,
    return_routed_experts: bool = False,
) -> dict[str, Any]:
    """``ServerArgs`` fields for one engine; ``colocated`` turns on ``enable_memory_saver``
    (needed by ``/release_memory_occupation``) and ``weights_cpu_backup`` keeps a host copy of
    the weights across a release (a pool nobody pushes again after it: the dedicated
    reference); ``api_key`` makes the server answer only requests with
    ``Authorization: Bearer KEY`` (SGLang exempts ``/health*`` and ``/metrics``);
    ``context_length`` (> 0) and ``model_overrides`` (``trainer.model_overrides``, resolved
    against the model's ``config.json`` by ``config/model_overrides.py`` and sent as
    ``--json-model-override-args``) serve the model as the trainer trains it; ``on_cpu`` adds
    :data:`CPU_SERVER_ARGS`; ``return_routed_experts`` lets ``/generate`` return each position's
    experts (a mixture-of-experts model, ``--enable-return-routed-experts``). ``extra_args``
    override the rest."""
    args: dict[str, Any] = {"api_key": api_key} if api_key else {}
    args |= {
        "model_path": model_path,
        "host": host,
        "port": port,
        "tp_size": tp,
        "mem_fraction_static": mem_fraction_static,
        "base_gpu_id": base_gpu_id,
    }
    if colocated:
        args["enable_memory_saver"] = True
        if weights_cpu_backup:
            args["enable_weights_cpu_backup"] = True
    if context_length > 0:
        args["context_length"] = context_length
    if model_overrides:
        served = resolve_model_overrides(read_hf_config(model_path) or {}, dict(model_overrides))
        args["json_model_override_args"] = json.dumps(served, sort_keys=True)
    if on_cpu:
        args.update(CPU_SERVER_ARGS)
    if return_routed_experts:
        args["enable_return_routed_experts"] = True
    args.update(extra_args or {})
    return args


def args_to_cli(args: dict[str, Any]) -> list[str]:
    """``{'tp_size': 2, 'enable_memory_saver': True}`` -> ``['--tp-size', '2', '--enable-memory-saver']``.

    ``False``/``None`` values are left out (SGLang's defaults); a list becomes several values.
    """
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, list | tuple):
            out += [flag, *(str(v) for v in value)]
        else:
            out += [flag, str(value)]
    return out


DEFAULT_SERVER_MODULE = "sglang.launch_server"


def build_server_command(
    args: dict[str, Any],
    known_fields: Iterable[str] | None = None,
    python: str = sys.executable,
    module: str = DEFAULT_SERVER_MODULE,
) -> list[str]:
    """``python -m sglang.launch_server ...`` (or ``module``: a site's wrapper taking the same
    flags) for ``args``, validated against ``known_fields``, by default the installed SGLang's
    ``ServerArgs`` (skipped only when SGLang is absent)."""
    fields = known_fields if known_fields is not None else server_arg_fields()
    if fields is not None:
        validate_server_args(args, fields)
    return [python, "-m", module, *args_to_cli(args)]


def build_router_command(
    worker_urls: list[str],
    port: int,
    host: str = "127.0.0.1",
    policy: str = "cache_aware",
    python: str = sys.executable,
    api_key: str = "",
) -> list[str]:
    """``python -m sglang_router.launch_router --host H --port P --worker-urls U... --policy X``
    (``--api-key KEY``: the key the router sends to the workers)."""
    if not worker_urls:
        raise ValueError("rollout.sglang.router needs at least one engine URL")
    if policy not in ROUTER_POLICIES:
        raise ValueError(f"sglang router policy={policy!r} is not one of {ROUTER_POLICIES}")
    return [
        python, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port),
        "--worker-urls", *worker_urls, "--policy", policy,
    ] + (["--api-key", api_key] if api_key else [])  # fmt: skip


def require_sglang(module: str = DEFAULT_SERVER_MODULE) -> None:
    """Fail early, with the fix, when the SGLang backend is asked for without SGLang, or when
    a custom ``rollout.sglang.server_module`` cannot be imported."""
    if module != DEFAULT_SERVER_MODULE:
        if importlib.util.find_spec(module) is None:
            raise RuntimeError(
                f"rollout.sglang.server_module={module!r} cannot be imported here; put its "
                "folder on PYTHONPATH, or use the default 'sglang.launch_server'"
            )
        return
    if server_arg_fields() is None:
        raise RuntimeError(
            "rollout.backend=sglang needs the sglang package (GPU clusters only): "
            "pip install -r requirements-gpu.txt, or set rollout.backend=torch"
        )


class ManagedProcess:
    """A server process we started: start, wait for a health URL, stop (its own pid only)."""

    def __init__(self, command: list[str], health_url: str, log_path: str | None = None) -> None:
        self.command = command
        self.health_url = health_url
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def start(self, env: dict[str, str | None] | None = None) -> None:
        """Start the process with this process's environment changed by ``env`` (a ``None``
        value removes the variable)."""
        changed = {**os.environ, **(env or {})}
        log = _private_log(self.log_path) if self.log_path else subprocess.DEVNULL
        # A new session: SGLang forks scheduler/detokenizer children, and stop() signals the
        # whole group this process leads (and nothing else).
        try:
            self.process = subprocess.Popen(
                command_with_parent(self.command),  # dies with this process (a kill -9 too)
                stdout=log,
                stderr=subprocess.STDOUT,
                env={k: v for k, v in changed.items() if v is not None},
                start_new_session=True,
            )
        finally:
            if log is not subprocess.DEVNULL:
                log.close()  # the child holds its own descriptor

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL of the process group at once (a wedged server: nothing to wait for)."""
        if self.process is None:
            return
        _signal_group(self.process.pid, signal.SIGKILL)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass

    def wait_healthy(self, timeout_s: float, poll_s: float = 1.0) -> None:
        """Poll ``health_url`` until HTTP 200; raise on timeout or if the process exits."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and not self.alive():
                raise RuntimeError(
                    f"{self.command[:3]} exited with code {self.process.returncode} before "
                    f"{self.health_url} answered; see {self.log_path or 'its output'}"
                )
            if http_ok(self.health_url, timeout_s=min(poll_s * 5, 30.0)):
                return
            time.sleep(poll_s)
        raise TimeoutError(
            f"{self.health_url} not healthy after {timeout_s:.0f}s; raise "
            "rollout.sglang.startup_timeout_s or check the server log"
        )

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the process group this process leads, SIGKILL after ``timeout_s``. The
        group is signalled even when the leader is already dead (a crashed server's scheduler
        and detokenizer children would otherwise keep their GPU memory and port). A server
        that blocks SIGTERM gets SIGKILL at once: one started by a Ray actor inherits the
        stop signals blocked (``orchestration/actors/ray_node.py``: it must outlive a preemption
        signal while the driver checkpoints), so a SIGTERM would only wait ``timeout_s`` out."""
        if self.process is None:
            return
        pgid = self.process.pid
        # a stopped process (SIGSTOP, a wedged server killed by the call deadlines) never acts
        # on a SIGTERM: SIGKILL at once, as for one that blocks it
        first = signal.SIGKILL if blocks_sigterm(pgid) or is_stopped(pgid) else signal.SIGTERM
        if not _signal_group(pgid, first):
            self.process.poll()
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and _group_alive(pgid):
            self.process.poll()  # reap the leader so it does not count as alive
            time.sleep(0.1)
        if _group_alive(pgid):
            _signal_group(pgid, signal.SIGKILL)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass


def _private_log(path: str):
    """``path`` opened for appending, readable by its owner only (SGLang prints its server
    arguments, the API key among them, at start-up)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab")


def blocks_sigterm(pid: int) -> bool:
    """Whether process ``pid`` holds SIGTERM blocked (``SigBlk`` of ``/proc/PID/status``,
    a hex mask whose bit ``n - 1`` is signal ``n``); False when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigBlk:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


def is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state ``T`` of ``/proc/PID/stat``: SIGSTOP);
    False when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


def _signal_group(pgid: int, sig: int) -> bool:
    """Signal process group ``pgid``; False when it no longer exists."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def _group_alive(pgid: int) -> bool:
    return _signal_group(pgid, 0)


def http_ok(url: str, timeout_s: float) -> bool:
    """True when a GET of ``url`` answers HTTP 200 within ``timeout_s``."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, TimeoutError):
        return False
