"""Contract tests against the pinned SGLang and sglang-router wheels, on CPU.

The wheels (versions from requirements-gpu.txt) are fetched once with ``pip download --no-deps``
into ``~/.cache/megatron_armor/wheels`` (``megatron_armor.doctor.pins.fetch_wheel``) and never
installed; where SGLang is installed at its pin (a GPU node) its installed sources are read
instead (``pins.pinned_sources``). SGLang's sources are read with ``ast``: its request structs (``io_struct.py``), its
HTTP routes (``http_server.py``), ``ServerArgs``'s command line (``arg_groups/fields``,
``server_args.py``) and ``SamplingParams``. The router's own argparse parser is imported from its
wheel and parses our command. SGLang's ``MultiprocessingSerializer`` (and its ``SafeUnpickler``)
are taken from the wheel's ``utils/common.py`` by ``ast`` too: importing that module needs triton
and a GPU stack. Its ``pybase64`` is the C-accelerated ``base64`` with the same functions.
Every request body comes from our payload builders, so renaming a key in them fails here.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_armor.doctor import pins
from megatron_armor.rollout.protocol import SamplingParams
from megatron_armor.rollout.sglang import client, launch
from megatron_armor.rollout.sglang import weights as transport
from megatron_armor.rollout.sglang.profile import ServerProfile


@pytest.fixture(scope="module")
def sglang_src() -> Path:
    """``sglang/`` of the pinned SGLang: the installed package at the pin (a GPU node), else
    the wheel, unpacked (``pins.pinned_sources``)."""
    return pins.pinned_sources("sglang", "sglang", pins.read_pins()["sglang"].version)


@pytest.fixture(scope="module")
def router_dir() -> Path:
    return pins.fetch_wheel("sglang-router", pins.read_pins()["sglang-router"].version)


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def class_fields(tree: ast.Module, name: str) -> tuple[set[str], set[str]]:
    """(all, required) annotated fields of class ``name`` and its bases in the same module."""
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    fields, required = set(), set()
    for base in classes[name].bases:
        if isinstance(base, ast.Name) and base.id in classes:
            more, more_required = class_fields(tree, base.id)
            fields, required = fields | more, required | more_required
    for node in classes[name].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if not node.target.id.startswith("_"):
                fields.add(node.target.id)
                if node.value is None:
                    required.add(node.target.id)
    return fields, required


def routes(http_server: Path) -> dict[str, set[str]]:
    """``{path: HTTP methods}`` of the FastAPI app (``@app.post``, ``@app.api_route``...)."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(parse(http_server)):
        for deco in getattr(node, "decorator_list", []):
            if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)):
                continue
            if not (deco.args and isinstance(deco.args[0], ast.Constant)):
                continue
            verb, path = deco.func.attr, deco.args[0].value
            methods = {verb.upper()} if verb in ("get", "post", "put", "delete") else set()
            for kw in deco.keywords:
                if kw.arg == "methods":
                    methods |= {m.value for m in kw.value.elts}
            out.setdefault(path, set()).update(methods)
    return out


def bucket() -> list[tuple[str, torch.Tensor]]:
    return [("model.embed_tokens.weight", torch.zeros(4, 2, dtype=torch.bfloat16)),
            ("lm_head.weight", torch.zeros(3))]  # fmt: skip


def our_bodies() -> dict[str, tuple[str, dict]]:
    """``{endpoint: (io_struct class, body)}`` of every JSON body we POST, from our builders."""
    generate = client.generate_payload([1, 2, 3], SamplingParams(stop_token_ids=(2,)), "r1", 7)
    return {
        "/generate": ("GenerateReqInput", generate),
        "/abort_request": ("AbortReq", client.abort_payload("r1")),
        "/update_weights_from_tensor": (
            "UpdateWeightsFromTensorReqInput",
            client.update_weights_from_tensor_payload(["tp0-b64", "tp1-b64"], version=3),
        ),
        "/update_weights_from_distributed": (
            "UpdateWeightsFromDistributedReqInput",
            client.update_weights_from_distributed_payload(
                **transport.bucket_metadata(bucket()), version=3, group_name="g-pp0"
            ),
        ),
        "/init_weights_update_group": (
            "InitWeightsUpdateGroupReqInput",
            client.init_weights_update_group_payload("10.0.0.1", 29500, 1, 3, "g-pp0"),
        ),
        "/destroy_weights_update_group": (
            "DestroyWeightsUpdateGroupReqInput",
            client.destroy_weights_update_group_payload("g-pp0"),
        ),
        "/update_weights_from_disk": (
            "UpdateWeightFromDiskReqInput",
            client.update_weights_from_disk_payload("/shared/v3", 3),
        ),
        "/release_memory_occupation": (
            "ReleaseMemoryOccupationReqInput",
            client.release_memory_occupation_payload(),
        ),
        "/resume_memory_occupation": (
            "ResumeMemoryOccupationReqInput",
            client.resume_memory_occupation_payload(["weights"]),
        ),
        "/pause_generation": ("PauseGenerationReqInput", client.pause_generation_payload()),
        "/continue_generation": ("ContinueGenerationReqInput", {}),
        transport.BEGIN_ENDPOINT: ("BeginWeightUpdateReqInput", {}),
        transport.END_ENDPOINT: ("EndWeightUpdateReqInput", {}),
        client.PROFILE_START: ("ProfileReq", TORCH_PROFILE.start_payload("sglang_0")),
    }


TORCH_PROFILE = ServerProfile("torch", (2,), "/runs/r/profile", own_nsys=False)
NSYS_PROFILE = ServerProfile("nsys", (2,), "/runs/r/profile", own_nsys=True)


@pytest.mark.unit
def test_memory_tags_are_sglangs_and_what_is_released_is_resumed(sglang_src):
    """A colocated server releases and resumes the same named tags, SGLang's own, and never
    ``cuda_graph`` (the loop has no step that resumes it)."""
    constants = (sglang_src / "srt/constants.py").read_text()
    sglang_tags = set(re.findall(r'GPU_MEMORY_TYPE_\w+ = "(\w+)"', constants))
    assert sglang_tags == {"kv_cache", "weights", "cuda_graph"}
    released = client.release_memory_occupation_payload()["tags"]
    assert set(released) < sglang_tags and "cuda_graph" not in released
    assert client.resume_memory_occupation_payload(None)["tags"] == released
    assert client.resume_memory_occupation_payload(["weights"])["tags"] == ["weights"]
    assert client.release_memory_occupation_payload(["kv_cache"])["tags"] == ["kv_cache"]
    with pytest.raises(ValueError, match="cuda_graph"):
        client.resume_memory_occupation_payload(["cuda_graph"])


@pytest.mark.unit
def test_every_body_has_exactly_fields_of_its_request_struct(sglang_src):
    tree = parse(sglang_src / "srt/managers/io_struct.py")
    served = routes(sglang_src / "srt/entrypoints/http_server.py")
    for endpoint, (struct, body) in our_bodies().items():
        fields, required = class_fields(tree, struct)
        assert set(body) <= fields, f"{endpoint}: {set(body) - fields} not fields of {struct}"
        assert required <= set(body), f"{endpoint}: {struct} needs {required - set(body)}"
        assert "POST" in served.get(endpoint, set()), f"SGLang serves no POST {endpoint}"
    assert "GET" in served["/health_generate"]  # SGLangClient.healthy: GET, no body
    assert "GET" in served["/server_info"]  # SGLangClient.scheduler_answers: GET, no body
    fields, _ = class_fields(tree, "ProfileReq")
    assert set(NSYS_PROFILE.start_payload("sglang_0")) <= fields
    assert "POST" in served[client.PROFILE_STOP]  # no body


@pytest.mark.unit
def test_profiled_servers_start_and_stop_the_capture_the_wheel_knows(sglang_src):
    """``CUDA_PROFILER`` makes a server call ``cudaProfilerStart``/``Stop`` (its own nsys
    session's capture range); CPU and GPU are its torch profiler's activities."""
    manager = (sglang_src / "srt/managers/scheduler_components/profiler_manager.py").read_text()
    assert '"CUDA_PROFILER" in activities' in manager and "cudaProfilerStart()" in manager
    for activity in (*NSYS_PROFILE.start_payload("s")["activities"],
                     *TORCH_PROFILE.start_payload("s")["activities"]):  # fmt: skip
        assert f'"{activity}"' in manager, activity


@pytest.mark.unit
def test_tensor_body_has_one_handle_per_server_tp_rank(sglang_src):
    """SGLang's TP worker deserializes ``serialized_named_tensors[tp_rank]`` only, so entry
    ``t`` must be the handle made on TP rank ``t``'s GPU, one entry per server TP rank."""
    worker = (sglang_src / "srt/managers/tp_worker.py").read_text()
    assert "serialized_named_tensors[get_parallel().tp_rank]" in worker
    handles = [f"bucket-on-tp{rank}" for rank in range(4)]
    body = client.update_weights_from_tensor_payload(handles, version=5)
    assert body["serialized_named_tensors"] == handles  # one per TP rank, in rank order
    assert body["weight_version"] == "5"


@pytest.mark.unit
def test_routed_experts_request_and_answer_follow_the_wheel(sglang_src):
    """Asking for routes sets a ``GenerateReqInput`` field; the answer decodes as the wheel's
    own decoder (``extract_routed_experts_from_meta_info``: base64 of int32) reads it."""
    fields, _ = class_fields(parse(sglang_src / "srt/managers/io_struct.py"), "GenerateReqInput")
    body = client.generate_payload([1, 2, 3], SamplingParams(), "r2", 7, return_routed_experts=True)
    assert body["return_routed_experts"] is True and set(body) <= fields
    source = (sglang_src / "srt/state_capturer/routed_experts.py").read_text()
    assert "b64decode(routed_experts_base64" in source and "dtype=np.int32" in source
    detok = (sglang_src / "srt/managers/detokenizer_manager.py").read_text()
    assert "b64encode(item.numpy().tobytes())" in detok  # the server's encoding of the ids


def wheel_function(path: Path, name: str):
    """Function (or method) ``name`` of a wheel module, compiled alone (no imports of its
    module run): for pure helpers such as ``FusedMoE.make_expert_params_mapping``."""
    tree = parse(path)
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    node.decorator_list = []
    namespace: dict = {}
    exec(
        compile(ast.Module([node], []), str(path), "exec"),
        {"List": list, "Tuple": tuple},
        namespace,
    )  # noqa: S102
    return namespace[name]


def qwen3_moe_load_weights(sglang_src: Path) -> ast.FunctionDef:
    tree = parse(sglang_src / "srt/models/qwen3_moe.py")
    cls = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Qwen3MoeForCausalLM"
    )
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "load_weights")


@pytest.mark.unit
def test_expert_weight_names_load_through_sglangs_qwen3_moe(sglang_src, tmp_path):
    """The tiny MoE's tensor names (the checkpoint's, which the trainer exports) through the
    name logic of the wheel's ``Qwen3MoeForCausalLM.load_weights``: its stacked map (q/k/v,
    gate/up of dense MLPs; expert names skipped) and ``FusedMoE.make_expert_params_mapping``
    (built as it builds it, from ``config.num_experts``): every expert tensor lands in its
    layer's fused ``w13`` (gate ``w1``, up ``w3``) or ``w2`` with its own expert id, the router
    in ``mlp.gate.weight``; none is left to the plain loader by mistake."""
    from safetensors import safe_open

    from megatron_armor.tiny.model import TinyModelConfig, write_model_dir

    method = qwen3_moe_load_weights(sglang_src)
    stacked = next(ast.literal_eval(n.value) for n in ast.walk(method) if isinstance(n, ast.Assign)
                   and getattr(n.targets[0], "id", "") == "stacked_params_mapping")  # fmt: skip
    call = next(n for n in ast.walk(method) if isinstance(n, ast.Call)
                and getattr(n.func, "attr", "") == "make_expert_params_mapping")  # fmt: skip
    kwargs = {k.arg: k.value for k in call.keywords}
    assert ast.unparse(kwargs.pop("num_experts")) == "self.config.num_experts"
    names = {k: ast.literal_eval(v) for k, v in kwargs.items()}
    mapping = wheel_function(
        sglang_src / "srt/layers/moe/fused_moe_triton/layer.py", "make_expert_params_mapping"
    )(None, **names, num_experts=4)
    model_dir = write_model_dir(tmp_path / "moe", TinyModelConfig(num_experts=4, num_layers=2))
    assert json.loads((model_dir / "config.json").read_text())["num_experts"] == 4
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        checkpoint = sorted(f.keys())
    loaded: dict[str, set] = {}
    for name in checkpoint:  # load_weights' branches, in its order
        stack = [(p, w, s) for p, w, s in stacked if w in name and "mlp.experts" not in name]
        experts = [(p, w, e, s) for p, w, e, s in mapping if w in name]
        if stack:
            target, shard = name.replace(stack[0][1], stack[0][0]), stack[0][2]
        elif experts:
            p, w, e, s = experts[0]
            target, shard = name.replace(w, p), (e, s)
        else:
            target, shard = name, None
        loaded.setdefault(target, set()).add(shard)
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp."
        w13 = {(e, s) for e in range(4) for s in ("w1", "w3")}
        assert loaded[prefix + "experts.w13_weight"] == w13
        assert loaded[prefix + "experts.w2_weight"] == {(e, "w2") for e in range(4)}
        assert loaded[prefix + "gate.weight"] == {None}
        assert loaded[f"model.layers.{layer}.self_attn.qkv_proj.weight"] == {"q", "k", "v"}
    assert not [
        t for t in loaded if ".experts." in t and not t.endswith(("w13_weight", "w2_weight"))
    ]


@pytest.mark.unit
def test_sampling_params_are_sglang_sampling_params(sglang_src):
    tree = parse(sglang_src / "srt/sampling/sampling_params.py")
    accepted, _ = class_fields(tree, "SamplingParams")
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=(5, 2))
    body = client.sampling_params_payload(params, seed=11)
    assert set(body) <= accepted, f"{set(body) - accepted} are not SamplingParams arguments"


def server_cli(sglang_src: Path) -> tuple[set[str], dict[str, str]]:
    """(every option string of ``launch_server``'s parser, ``{field: annotation source}``).

    Fields are the annotated names of the namespace structs in ``arg_groups/fields/`` plus
    ``ServerArgs``'s own; a field's flag is ``Arg(cli_name=...)`` or ``--`` + name with ``-``,
    plus its ``aliases`` (SGLang's ``add_cli_args_from_dataclass``); fields marked
    ``no_cli=True`` have none. Flags registered by hand in ``add_cli_args`` are added."""
    options, annotations = set(), {}
    sources = sorted((sglang_src / "srt/arg_groups/fields").glob("*.py"))
    for path in [*sources, sglang_src / "srt/server_args.py"]:
        for cls in (n for n in parse(path).body if isinstance(n, ast.ClassDef)):
            for node in cls.body:
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    name = node.target.id
                    if not name.startswith("_"):
                        annotations[name] = ast.unparse(node.annotation)
                        options |= field_flags(name, node.annotation)
    for node in ast.walk(parse(sglang_src / "srt/server_args.py")):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            options |= {a.value for a in node.args if isinstance(a, ast.Constant)}
    return options, annotations


def field_flags(name: str, annotation: ast.expr) -> set[str]:
    call = next((n for n in ast.walk(annotation) if isinstance(n, ast.Call)), None)
    keywords = {kw.arg: kw.value for kw in call.keywords} if call is not None else {}
    if isinstance(keywords.get("no_cli"), ast.Constant) and keywords["no_cli"].value:
        return set()
    cli = keywords.get("cli_name")
    flags = {cli.value if isinstance(cli, ast.Constant) else "--" + name.replace("_", "-")}
    aliases = keywords.get("aliases")
    return flags | {a.value for a in getattr(aliases, "elts", [])}


@pytest.mark.unit
def test_server_flags_are_sglang_server_args(sglang_src):
    options, annotations = server_cli(sglang_src)
    extra = {"enable_deterministic_inference": True, "max_running_requests": 64}
    args = launch.server_args_for(
        "/models/qwen", 30000, tp=2, host="10.0.0.2", base_gpu_id=4, colocated=True,
        extra_args=extra, return_routed_experts=True,
    )  # fmt: skip
    command = launch.build_server_command(args, known_fields=annotations, python="python")
    flags = [token for token in command if token.startswith("--")]
    assert set(flags) <= options, f"{set(flags) - options} are not launch_server flags"
    assert "--enable-return-routed-experts" in flags
    bare = [k for k, v in args.items() if v is True]
    assert bare and all(annotations[k].startswith("A[bool") for k in bare), bare
    with pytest.raises(ValueError, match="not fields of SGLang's ServerArgs"):
        launch.build_server_command({"tp": 2}, known_fields=annotations)


@pytest.mark.unit
def test_router_command_parses_with_the_routers_own_parser(router_dir):
    command = launch.build_router_command(["http://10.0.0.2:30000"], 29000, policy="round_robin")
    code = (
        "import argparse, json, sys\n"
        "from sglang_router.router_args import RouterArgs\n"
        "parser = argparse.ArgumentParser()\n"
        "RouterArgs.add_cli_args(parser)\n"
        "print(json.dumps(vars(parser.parse_args(sys.argv[1:]))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, *command[3:]], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(router_dir)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    parsed = json.loads(result.stdout.strip().splitlines()[-1])
    assert parsed["worker_urls"] == ["http://10.0.0.2:30000"] and parsed["policy"] == "round_robin"
    assert (parsed["host"], parsed["port"]) == ("127.0.0.1", 29000)


SERIALIZER = r"""
import ast, base64, io, pickle, sys
from multiprocessing.reduction import ForkingPickler
import torch

def sglang_serializer(common_py):
    names = {"MultiprocessingSerializer", "SafeUnpickler", "_safe_load_torch_storage"}
    tree = ast.parse(open(common_py).read())
    body = [n for n in tree.body if getattr(n, "name", None) in names]
    scope = {"io": io, "pickle": pickle, "ForkingPickler": ForkingPickler, "torch": torch,
             "pybase64": base64}
    exec(compile(ast.Module(body=body, type_ignores=[]), common_py, "exec"), scope)
    return scope["MultiprocessingSerializer"]
"""

RECEIVER = (
    SERIALIZER
    + r"""
serializer = sglang_serializer(sys.argv[1])
payload = sys.stdin.read()
try:
    data = serializer.deserialize(payload)
    print("RECEIVED", data["flattened_tensor"].device, data["flattened_tensor"].sum().item())
except Exception as err:
    print("FAILED", type(err).__name__, err)
"""
)


def round_trip(sglang_src: Path, device: str) -> str:
    """Serialize a flattened bucket on ``device`` here with SGLang's serializer and
    deserialize it in an independent process (as the server's scheduler would)."""
    scope: dict = {}
    exec(SERIALIZER, scope)
    common = str(sglang_src / "srt/utils/common.py")
    flat = torch.arange(6, dtype=torch.float32, device=device).view(torch.uint8)
    payload = scope["sglang_serializer"](common).serialize(
        {"flattened_tensor": flat, "metadata": []}, output_str=True
    )
    result = subprocess.run(
        [sys.executable, "-c", RECEIVER, common], input=payload, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()[-1]


NAMED_RECEIVER = (
    SERIALIZER
    + r"""
serializer = sglang_serializer(sys.argv[1])
named = serializer.deserialize(sys.stdin.read())
print("RECEIVED", [(name, t.device.type, float(t.double().sum())) for name, t in named])
"""
)


@pytest.mark.unit
def test_cpu_tensors_cannot_travel_as_shared_memory(sglang_src):
    """SGLang's serializer shares a CPU tensor as a file descriptor that an independent process
    cannot open; the CUDA form refuses CPU tensors (the CPU form travels inline: the next
    test)."""
    assert round_trip(sglang_src, "cpu").startswith("FAILED AuthenticationError")
    with pytest.raises(ValueError, match="weight_transport=tensor got CPU tensors"):
        transport.serialize_cuda_bucket(bucket())


@pytest.mark.gpu
@pytest.mark.unit
def test_a_bucket_made_here_is_received_in_an_independent_process(sglang_src, device, cuda_only):
    """The ``tensor`` transport's payload for this device, opened by SGLang's own code in an
    independent process (as the server's scheduler would): on a GPU a flattened bucket's
    CUDA-IPC handle; on CPU the inline form (``serialize_cpu_bucket``), read by SGLang's
    ``SafeUnpickler`` (the real server takes it: the sglang tier's
    ``test_tensor_update_with_the_cpu_payload``)."""
    if cuda_only("a CUDA-IPC handle needs CUDA"):
        expected = int(torch.arange(6, dtype=torch.float32).view(torch.uint8).sum())
        assert round_trip(sglang_src, "cuda") == f"RECEIVED cuda:0 {expected}"
        return
    named = bucket()
    serialized = transport.serialize_cpu_bucket(named)
    assert serialized.load_format is None
    common = str(sglang_src / "srt/utils/common.py")
    result = subprocess.run(
        [sys.executable, "-c", NAMED_RECEIVER, common], input=serialized.text,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    expected = [(name, "cpu", float(t.double().sum())) for name, t in named]
    assert result.stdout.strip().splitlines()[-1] == f"RECEIVED {expected}"
