"""A stand-in for the model hub's HTTP API on localhost: one repository of plain files.

It answers what huggingface_hub's ``hf_hub_download`` and ``snapshot_download`` ask (the
revision's commit, the file tree, ``HEAD`` / ``GET`` of ``resolve/<revision>/<file>``), so the real
client runs its real download path against it, with ``HF_ENDPOINT`` pointing here. Every request
is recorded in :attr:`FakeHub.requests`. No network beyond 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlparse


@dataclass
class FakeHub:
    """One repository ``repo_id`` at commit ``commit`` holding ``files`` (name -> bytes).

    ``more`` holds further repositories (repo id -> files) at the same commit; any other repository
    is answered as the hub answers one that does not exist. The bodies of the files named in
    ``dropped`` are cut off partway (the connection closes after half of the bytes the
    ``Content-Length`` announced): a network that fails in the middle of a file.
    """

    repo_id: str
    commit: str
    files: dict[str, bytes]
    requests: list[str] = field(default_factory=list)
    dropped: frozenset[str] = frozenset()
    more: dict[str, dict[str, bytes]] = field(default_factory=dict)
    server: Any = None

    @property
    def endpoint(self) -> str:
        """The ``HF_ENDPOINT`` of the running server."""
        return f"http://127.0.0.1:{self.server.server_port}"

    def __enter__(self) -> FakeHub:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def answer(self, path: str) -> tuple[int, bytes, dict[str, str]]:
        """The status, body and headers for a request path."""
        for repo_id, files in {self.repo_id: self.files, **self.more}.items():
            answered = self._answer(repo_id, files, path)
            if answered is not None:
                return answered
        return 404, b"", {"X-Error-Code": "RepoNotFound"}

    def _answer(self, repo_id: str, files: dict[str, bytes], path: str) -> tuple[int, bytes, dict[str, str]] | None:
        """The answer of one repository (``None``: the path is not about it)."""
        api = f"/api/models/{repo_id}/"
        if path.startswith(api + "revision/"):
            siblings = [{"rfilename": name} for name in files]
            return 200, json.dumps({"id": repo_id, "sha": self.commit, "siblings": siblings}).encode(), {}
        if path.startswith(api + "tree/"):
            tree = [
                {"type": "file", "path": name, "size": len(body), "oid": hashlib.sha1(body).hexdigest()}
                for name, body in files.items()
            ]
            return 200, json.dumps(tree).encode(), {}
        prefix = f"/{repo_id}/resolve/"
        if path.startswith(prefix):
            name = path[len(prefix) :].partition("/")[2]
            if name not in files:
                return 404, b"", {"X-Error-Code": "EntryNotFound"}
            body = files[name]
            return 200, body, {"X-Repo-Commit": self.commit, "ETag": f'"{hashlib.sha1(body).hexdigest()}"'}
        return None


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _reply(self, send_body: bool) -> None:
            hub.requests.append(f"{self.command} {urlparse(self.path).path}")
            status, body, headers = hub.answer(unquote(urlparse(self.path).path))
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if send_body and any(self.path.endswith(f"/{name}") for name in hub.dropped):
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)  # the rest never comes
            elif send_body:
                self.wfile.write(body)

        def do_GET(self) -> None:
            self._reply(True)

        def do_HEAD(self) -> None:
            self._reply(False)

    return Handler
