"""SGLang rollout backend (GPU clusters): server launch, HTTP client, weight transports, engine.

Endpoint names and payloads were checked against SGLang's sources (sgl-project/sglang, the
v0.5.x line: ``python/sglang/srt/entrypoints/http_server.py`` of 0.5.3 and
``managers/io_struct.py``, ``server_args.py``, ``sampling/sampling_params.py`` of the 2026
main branch) and the router's ``sglang_router.launch_router`` arguments. SGLang itself is
imported lazily, only where a GPU path needs it (tensor serialization, ``ServerArgs``
validation), so this package imports on a CPU machine.
"""
