"""A stand-in for the Hugging Face hub (an ``HF_ENDPOINT`` mirror) serving one model repository
from a local directory, so that docs/cluster.md's ``hf download`` runs on the CI cluster, which
has no network to the hub.

It answers what ``hf download REPO --local-dir DIR`` (huggingface_hub's ``snapshot_download``)
asks: the repository's revision (``/api/models/REPO/revision/REV``), its file tree
(``/api/models/REPO/tree/REV``) and each file (``HEAD``/``GET /REPO/resolve/REV/FILE``, with the
commit and ETag headers the client checks). What it cannot show: authentication, gated or
private repositories, Xet and LFS storage, pagination of large trees, rate limits, datasets.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class HubMirror:
    """``HubMirror(directory, repo_id)``: ``with`` it, ``endpoint`` is its URL (``HF_ENDPOINT``)."""

    def __init__(self, directory: Path, repo_id: str):
        self.directory = Path(directory)
        self.repo_id = repo_id
        self.files = sorted(
            str(p.relative_to(self.directory)) for p in self.directory.rglob("*") if p.is_file()
        )
        digest = hashlib.sha1()
        for name in self.files:
            digest.update(name.encode() + (self.directory / name).read_bytes())
        self.sha = digest.hexdigest()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"

    def __enter__(self) -> HubMirror:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def tree(self) -> list[dict]:
        return [{"type": "file", "path": name, "size": (self.directory / name).stat().st_size,
                 "oid": hashlib.sha1((self.directory / name).read_bytes()).hexdigest()}
                for name in self.files]  # fmt: skip

    def _handler(self):
        mirror = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet: the test prints what failed
                pass

            def do_HEAD(self) -> None:
                self.answer(body=False)

            def do_GET(self) -> None:
                self.answer(body=True)

            def answer(self, body: bool) -> None:
                path = unquote(urlparse(self.path).path)
                api = f"/api/models/{mirror.repo_id}"
                resolve = f"/{mirror.repo_id}/resolve/"
                if path == api or path.startswith(f"{api}/revision/"):
                    info = {"id": mirror.repo_id, "modelId": mirror.repo_id, "sha": mirror.sha,
                            "siblings": [{"rfilename": f} for f in mirror.files]}  # fmt: skip
                    self.send(json.dumps(info).encode(), "application/json", body)
                elif path.startswith(f"{api}/tree/"):
                    self.send(json.dumps(mirror.tree()).encode(), "application/json", body)
                elif (
                    path.startswith(resolve)
                    and path[len(resolve) :].partition("/")[2] in mirror.files
                ):
                    name = path[len(resolve) :].partition("/")[2]
                    self.send((mirror.directory / name).read_bytes(), "application/octet-stream",
                              body, etag=hashlib.sha256(name.encode() + mirror.sha.encode()).hexdigest())  # fmt: skip
                else:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()

            def send(self, data: bytes, kind: str, body: bool, etag: str = "") -> None:
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("X-Repo-Commit", mirror.sha)
                if etag:
                    self.send_header("ETag", f'"{etag}"')
                self.end_headers()
                if body:
                    self.wfile.write(data)

        return Handler
