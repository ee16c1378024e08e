"""A stand-in for the Hugging Face hub on 127.0.0.1, in a thread: the endpoints huggingface_hub's
snapshot_download and hf_hub_download call, answered the way the hub answers them, over plain HTTP (no Xet
headers, so no Xet transfer). Every request is recorded with its headers.

    GET  /api/models/{org}/{name}/revision/{rev}   repo info: the commit `sha` a branch, tag or commit names
    GET  /api/models/{org}/{name}/tree/{rev}       the file list (one page, `recursive` or not)
    HEAD /{org}/{name}/resolve/{rev}/{path}        X-Repo-Commit, ETag, Content-Length
    GET  /{org}/{name}/resolve/{rev}/{path}        the bytes; `Range: bytes=N-` gets 206 and the rest

Errors carry the hub's X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo), from which
huggingface_hub picks its exception classes.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

API = re.compile(r"/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)")
RESOLVE = re.compile(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)")
RANGE = re.compile(r"bytes=(\d+)-$")


def folder_files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` by its path relative to it, as a repo revision."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@dataclass
class FakeRepo:
    revisions: dict[str, dict[str, bytes]]  # branch or tag -> {path: bytes}
    token: str | None = None  # gated: files need `Authorization: Bearer <token>`; the API answers anyone

    def commits(self) -> dict[str, str]:
        """Commit hash -> branch or tag."""
        return {hashlib.sha1(name.encode()).hexdigest(): name for name in self.revisions}

    def files(self, revision: str) -> tuple[str, dict[str, bytes]] | None:
        """(commit, files) of a branch, tag or commit hash; None for an unknown revision."""
        commits = self.commits()
        name = commits.get(revision, revision)
        if name not in self.revisions:
            return None
        return next(c for c, n in commits.items() if n == name), self.revisions[name]


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # without the query
    headers: dict[str, str]  # lower-case names


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo]
    requests: list[Request] = field(default_factory=list)
    # "org/name/path": the next GET of that file sends half its bytes, then closes the connection.
    cut_short: set[str] = field(default_factory=set)

    def __post_init__(self):
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop answering: the port refuses connections afterwards (every response closed its connection)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def fetched(self, method: str = "GET") -> list[str]:
        """'org/name/path' of every file request with this method, in order."""
        found = [RESOLVE.fullmatch(r.path) for r in self.requests if r.method == method]
        return [f"{m[1]}/{m[3]}" for m in found if m]

    def paths(self) -> list[str]:
        return [r.path for r in self.requests]


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args):  # quiet: the test reads hub.requests
            pass

        def do_GET(self):
            self.answer(body=True)

        def do_HEAD(self):
            self.answer(body=False)

        def answer(self, body: bool) -> None:
            path = urlsplit(self.path).path  # matched quoted: a quoted revision may hold a '/'
            hub.requests.append(Request(self.command, unquote(path), {k.lower(): v for k, v in self.headers.items()}))
            if match := API.fullmatch(path):
                self.api(unquote(match[1]), match[2], unquote(match[3]))
            elif match := RESOLVE.fullmatch(path):
                self.resolve(unquote(match[1]), unquote(match[2]), unquote(match[3]), body)
            else:
                self.error(404, "RepoNotFound", "Repository not found")

        def api(self, repo_id: str, kind: str, revision: str) -> None:
            found = self.revision(repo_id, revision)
            if found is None:
                return
            commit, files = found
            if kind == "revision":
                siblings = [{"rfilename": p} for p in files]
                data = {"id": repo_id, "sha": commit, "private": False, "gated": hub.repos[repo_id].token is not None,
                        "siblings": siblings}  # fmt: skip
            else:
                folders = sorted({p.rsplit("/", 1)[0] for p in files if "/" in p})
                data = [
                    {"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d}
                    for d in folders
                ]
                data += [
                    {"type": "file", "oid": hashlib.sha1(b).hexdigest(), "size": len(b), "path": p}
                    for p, b in files.items()
                ]
            self.send(200, json.dumps(data).encode(), {"Content-Type": "application/json"})

        def resolve(self, repo_id: str, revision: str, name: str, body: bool) -> None:
            found = self.revision(repo_id, revision)
            if found is None:
                return
            commit, files = found
            token = hub.repos[repo_id].token
            if token is not None and self.headers.get("Authorization") != f"Bearer {token}":
                return self.error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have "
                                  "access to it and be authenticated to access it. Please log in.")  # fmt: skip
            if name not in files:
                return self.error(404, "EntryNotFound", f"{name} does not exist on {revision}", commit)
            data = files[name]
            headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                       "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}  # fmt: skip
            start = RANGE.match(self.headers.get("Range", ""))
            if start and body:
                first = int(start[1])
                headers["Content-Range"] = f"bytes {first}-{len(data) - 1}/{len(data)}"
                return self.send(206, data[first:], headers)
            key = f"{repo_id}/{name}"
            if body and key in hub.cut_short:
                hub.cut_short.discard(key)
                return self.send(200, data, headers, cut_after=len(data) // 2)
            self.send(200, data, headers, body=body)

        def revision(self, repo_id: str, revision: str) -> tuple[str, dict[str, bytes]] | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self.error(404, "RepoNotFound", "Repository not found")
                return None
            found = repo.files(revision)
            if found is None:
                self.error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return found

        def error(self, status: int, code: str, message: str, commit: str | None = None) -> None:
            headers = {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"}
            if commit is not None:
                headers["X-Repo-Commit"] = commit
            self.send(status, json.dumps({"error": message}).encode(), headers, body=self.command != "HEAD")

        def send(self, status: int, data: bytes, headers: dict[str, str], body: bool = True, cut_after=None) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")  # no kept-alive connection outlives stop()
            self.end_headers()
            if body:
                self.wfile.write(data if cut_after is None else data[:cut_after])

    return Handler
