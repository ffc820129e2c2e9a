"""A local HTTP server that speaks the Hugging Face Hub's file protocol, for tests that drive the real
`huggingface_hub` client at it through `HF_ENDPOINT`.

It serves `HEAD` and `GET /{repo}/resolve/{revision}/{file}` as the Hub does: the resolved commit in
`X-Repo-Commit`, the file's `ETag` and size, ranged `GET`s (206) for resumed downloads, and the Hub's
error codes in `X-Error-Code` (`RepoNotFound`, `RevisionNotFound`, `EntryNotFound`, `GatedRepo`).
A repository is a set of commits (file name -> bytes) and refs (branch or tag -> commit); a gated one
answers only requests with its token. `interrupt_once` makes the next full download of a file stop
half way (the connection closes), as a dropped link would. Every request is logged.
"""

from __future__ import annotations

import hashlib
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = re.compile(r"^[0-9a-f]{40}$")
RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<revision>[^/]+)/(?P<file>.+)$")


@dataclass
class FakeRepo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    token: str | None = None  # gated: requests must carry this token

    def publish(self, directory: Path, ref: str = "main") -> str:
        """Every file of `directory` as a new commit that `ref` points to; returns the commit."""
        files = {path.name: path.read_bytes() for path in sorted(directory.iterdir()) if path.is_file()}
        commit = hashlib.sha1(b"".join(files[name] for name in sorted(files))).hexdigest()
        self.commits[commit] = files
        self.refs[ref] = commit
        return commit


@dataclass(frozen=True)
class Request:
    method: str
    repo: str
    revision: str
    file: str
    status: int


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[Request] = []
        self.interrupt_once: set[tuple[str, str]] = set()  # (repo, file): its next full GET stops half way
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.shutdown()
        self._server.server_close()

    def fetched(self, repo: str) -> list[str]:
        """Names of the files of `repo` whose content was sent (complete or not)."""
        return [
            r.file for r in self.requests if r.repo == repo and r.method == "GET" and r.status in (200, 206)
        ]

    def _log(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # the test reads `hub.requests` instead
                pass

            def do_HEAD(self) -> None:  # noqa: N802  (http.server's naming)
                self._serve(body=False)

            def do_GET(self) -> None:  # noqa: N802
                self._serve(body=True)

            def _error(self, status: int, code: str, message: str, where: tuple[str, str, str]) -> None:
                hub._log(Request(self.command, *where, status))
                payload = message.encode()
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command == "GET":
                    self.wfile.write(payload)

            def _serve(self, body: bool) -> None:
                match = RESOLVE.match(self.path.split("?", 1)[0])
                if match is None:
                    self._error(404, "EntryNotFound", "not a file URL", ("", "", self.path))
                    return
                repo_id, revision, name = match["repo"], match["revision"], match["file"]
                where = (repo_id, revision, name)
                repo = hub.repos.get(repo_id)
                if repo is None:
                    self._error(404, "RepoNotFound", f"Repository Not Found for url: {self.path}", where)
                    return
                if repo.token is not None and self.headers.get("authorization") != f"Bearer {repo.token}":
                    self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted.", where)
                    return
                commit = (
                    revision
                    if COMMIT.match(revision) and revision in repo.commits
                    else repo.refs.get(revision)
                )
                if commit is None:
                    self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", where)
                    return
                content = repo.commits[commit].get(name)
                if content is None:
                    self._error(404, "EntryNotFound", f"Entry not found: {name}", where)
                    return
                start, end = 0, len(content)
                ranged = re.match(r"bytes=(\d+)-(\d*)$", self.headers.get("range", ""))
                if body and ranged:
                    start = min(int(ranged[1]), len(content))
                    end = min(int(ranged[2]) + 1, len(content)) if ranged[2] else len(content)
                status = 206 if body and ranged else 200
                hub._log(Request(self.command, repo_id, revision, name, status))
                self.send_response(status)
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", f'"{hashlib.sha256(content).hexdigest()}"')
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(end - start))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(content)}")
                self.end_headers()
                if not body:
                    return
                if start == 0 and (repo_id, name) in hub.interrupt_once:
                    hub.interrupt_once.discard((repo_id, name))
                    self.wfile.write(content[: len(content) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)  # a dropped link: half the promised bytes, then nothing
                    return
                self.wfile.write(content[start:end])

        return Handler
