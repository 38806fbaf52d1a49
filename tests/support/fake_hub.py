"""A loopback HTTP server speaking enough of the Hugging Face Hub API for the real huggingface_hub client.

Repos live in memory: {repo_id: {commit_sha: {path: bytes}}} plus refs ("main" -> sha). Every request is
recorded (so a test can assert that nothing was asked), gated repos answer 401/403 like the Hub, and a file
transfer can be cut off after N bytes once (to exercise Range resume).
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".model")
LFS_MIN_SIZE = 10_000


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(path: str, data: bytes) -> bool:
    return path.endswith(LFS_SUFFIXES) or len(data) >= LFS_MIN_SIZE


def etag_of(path: str, data: bytes) -> str:
    """What the Hub puts in ETag: the sha256 for LFS files, the git blob sha1 otherwise."""
    return hashlib.sha256(data).hexdigest() if is_lfs(path, data) else git_blob_sha1(data)


@dataclass
class Repo:
    revisions: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    gated: str | bool = False  # False, "auto" or "manual"
    allowed_tokens: set[str] = field(default_factory=set)


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    authorization: str | None


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[Request] = []
        self._cuts: dict[str, int] = {}  # path in repo -> bytes to send before dropping the connection (once)
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -------------------------------------------------------------- setup
    def add_revision(self, repo_id: str, files: dict[str, bytes], *, ref: str | None = "main",
                     gated: str | bool | None = None, allowed_tokens: Iterable[str] = ()) -> str:
        """Adds a commit holding `files` (moving `ref` to it) and returns its 40-hex sha."""
        repo = self.repos.setdefault(repo_id, Repo())
        digest = hashlib.sha1(repo_id.encode() + str(len(repo.revisions)).encode())
        for path in sorted(files):
            digest.update(path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
        sha = digest.hexdigest()
        repo.revisions[sha] = dict(files)
        if ref:
            repo.refs[ref] = sha
        if gated is not None:
            repo.gated = gated
        repo.allowed_tokens.update(allowed_tokens)
        return sha

    def cut_once(self, path: str, after_bytes: int) -> None:
        """The next GET of `path` (in any repo) sends `after_bytes` bytes, then drops the connection."""
        with self._lock:
            self._cuts[path] = after_bytes

    def reset_requests(self) -> None:
        with self._lock:
            self.requests.clear()

    def gets(self, suffix: str) -> list[Request]:
        return [r for r in self.requests if r.method == "GET" and r.path.split("?")[0].endswith(suffix)]

    # -------------------------------------------------------------- lifecycle
    def start(self) -> str:
        hub = self

        class Handler(_Handler):
            fake = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True)
        self._thread.start()
        return self.endpoint

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def endpoint(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def _take_cut(self, path: str) -> int | None:
        with self._lock:
            return self._cuts.pop(path, None)


# `/api/models/<repo>` (no revision: the default branch) or `/api/models/<repo>/(revision|tree)/<rev>[/<path>]`
_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+?)(?:/(?P<kind>revision|tree)/(?P<rev>[^/]+)(?P<sub>/.*)?)?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


class _Handler(BaseHTTPRequestHandler):
    fake: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # silence the default stderr log
        pass

    # -------------------------------------------------------------- helpers
    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
              content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str, extra: dict[str, str] | None = None) -> None:
        headers = {"X-Error-Code": code, "X-Error-Message": message, **(extra or {})}
        self._send(status, json.dumps({"error": message}).encode(), headers)

    def _revision(self, repo_id: str, rev: str) -> tuple[Repo, str] | None:
        """The repo and the commit a revision names; None after answering 404 when either is unknown."""
        repo = self.fake.repos.get(repo_id)
        if repo is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        sha = repo.refs.get(rev, rev if rev in repo.revisions else None)
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return repo, sha

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization")
        return auth.split(" ", 1)[1] if auth and auth.lower().startswith("bearer ") else None

    # -------------------------------------------------------------- verbs
    def do_HEAD(self):
        self._dispatch()

    def do_GET(self):
        self._dispatch()

    def _dispatch(self) -> None:
        with self.fake._lock:
            self.fake.requests.append(Request(self.command, self.path, self.headers.get("Range"),
                                              self.headers.get("Authorization")))
        url = urlsplit(self.path)
        path = url.path
        if m := _API.match(path):
            return self._api(unquote(m["repo"]), m["kind"] or "revision", unquote(m["rev"] or "main"), m["sub"],
                             parse_qs(url.query))
        if m := _RESOLVE.match(path):
            return self._resolve(unquote(m["repo"]), unquote(m["rev"]), unquote(m["file"]))
        self._error(404, "EntryNotFound", "Not found")

    def _api(self, repo_id: str, kind: str, rev: str, sub: str | None, query: dict) -> None:
        found = self._revision(repo_id, rev)
        if found is None:
            return
        repo, sha = found
        files = repo.revisions[sha]
        if kind == "revision":
            body = {"id": repo_id, "modelId": repo_id, "sha": sha, "private": False, "gated": repo.gated,
                    "disabled": False, "siblings": [{"rfilename": p} for p in sorted(files)]}
            return self._send(200, json.dumps(body).encode())
        # tree: one page, whatever `cursor`/`limit`/`expand` say (no Link header => no next page)
        prefix = unquote(sub or "").strip("/")
        entries = []
        for p in sorted(files):
            if prefix and not p.startswith(prefix + "/"):
                continue
            data = files[p]
            entry = {"type": "file", "path": p, "size": len(data), "oid": git_blob_sha1(data)}
            if is_lfs(p, data):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            entries.append(entry)
        self._send(200, json.dumps(entries).encode())

    def _resolve(self, repo_id: str, rev: str, filename: str) -> None:
        found = self._revision(repo_id, rev)
        if found is None:
            return
        repo, sha = found
        if repo.gated:
            token = self._token()
            if token is None:
                return self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have "
                                   "access to it and be authenticated to access it. Please log in.")
            if token not in repo.allowed_tokens:
                return self._error(403, "GatedRepo", f"Access to model {repo_id} is restricted and you are not "
                                   f"in the authorized list. Visit https://huggingface.co/{repo_id} to ask for access.")
        data = repo.revisions[sha].get(filename)
        if data is None:
            return self._error(404, "EntryNotFound", f"{filename} does not exist on \"{rev}\"",
                               {"X-Repo-Commit": sha})
        headers = {"X-Repo-Commit": sha, "ETag": f'"{etag_of(filename, data)}"', "Accept-Ranges": "bytes"}
        start, status = 0, 200
        rng = self.headers.get("Range")
        if rng and (m := _RANGE.match(rng.strip())) and self.command == "GET":
            start = int(m[1])
            stop = int(m[2]) + 1 if m[2] else len(data)
            if start >= len(data):
                return self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
            status = 206
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{len(data)}"
            body = data[start:stop]
        else:
            body = data
        cut = self.fake._take_cut(filename) if self.command == "GET" else None
        if cut is None:
            return self._send(status, body, headers, "application/octet-stream")
        # Announce the full length, send part of it, then drop the connection.
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body[:cut])
        self.wfile.flush()
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
