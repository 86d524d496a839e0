"""A tiny stand-in for the Hugging Face Hub on 127.0.0.1 that the REAL ``huggingface_hub`` client talks to.

It answers the requests ``HfApi.whoami``, ``create_repo`` and ``upload_folder`` make (huggingface_hub 2.x,
read in its source: ``/api/whoami-v2``; ``/api/repos/create``; ``/api/models/{repo}/preupload/{rev}``, whose
answer sends every file "regular", i.e. inside the commit; ``/api/models/{repo}/commit/{rev}``, an NDJSON
body with each file base64-encoded; ``/api/validate-yaml`` on the path without ``hf_xet``) and records every
request, so a test sees which repositories were created how and which files went up, byte for byte.
"""

from __future__ import annotations

import base64
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Hub:
    url: str = ""
    requests: list[tuple[str, str]] = field(default_factory=list)
    """(method, path) of every request, in order."""
    created: dict[str, dict] = field(default_factory=dict)
    """repo id -> the create_repo payload."""
    files: dict[str, dict[str, bytes]] = field(default_factory=dict)
    """repo id -> {path in repo: bytes committed}."""
    tokens: list[str] = field(default_factory=list)
    good_token: str = "hf_test_token"


def _post(hub: Hub, path: str, body: bytes) -> tuple[int, dict]:
    """The answer to a POST the client makes while creating a repo and uploading a folder."""
    if path == "/api/repos/create":
        payload = json.loads(body)
        repo = f"{payload.get('organization') or 'tester'}/{payload['name']}"
        hub.created[repo] = payload
        return 200, {"url": f"{hub.url}/{repo}"}
    if path == "/api/validate-yaml":
        return 200, {"errors": [], "warnings": []}
    if path.startswith("/api/models/") and "/preupload/" in path:  # every file inside the commit ("regular")
        files = json.loads(body)["files"]
        return 200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None}
                               for f in files]}
    if path.startswith("/api/models/") and "/commit/" in path:
        repo = path[len("/api/models/"):].split("/commit/")[0]
        for item in map(json.loads, body.splitlines()):
            if item["key"] == "file":
                hub.files.setdefault(repo, {})[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
        return 200, {"commitUrl": f"{hub.url}/{repo}/commit/{'a' * 40}", "commitOid": "a" * 40,
                     "pullRequestUrl": None}
    return 404, {"error": f"not served: {path}"}


def _handler(hub: Hub):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self, method: str) -> bool:
            """Record the request; answer 401 (and False) unless it carries the good token."""
            hub.requests.append((method, self.path.split("?")[0]))
            token = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
            hub.tokens.append(token)
            if token != hub.good_token:
                self._send(401, {"error": "Invalid credentials in Authorization header"})
                return False
            return True

        def do_GET(self):  # noqa: N802
            if self._authorized("GET"):
                if self.path.startswith("/api/whoami-v2"):
                    self._send(200, {"type": "user", "name": "tester", "auth": {}})
                else:
                    self._send(404, {"error": f"not served: {self.path}"})

        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self._authorized("POST"):
                self._send(*_post(hub, self.path.split("?")[0], body))

    return Handler


def start() -> tuple[Hub, ThreadingHTTPServer]:
    """A running fake Hub (``hub.url``) and its server (``server.shutdown()`` stops it)."""
    hub = Hub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return hub, server
