"""A local imitation of the Hugging Face Hub's HTTP API, for tests without internet.

``LocalHub({"org/name": folder})`` serves each folder as the single revision of a model repository, at a fixed
commit sha (``COMMIT``); the branch ``main`` and that sha both resolve to it. Point ``huggingface_hub`` at it with
``HF_ENDPOINT`` (or ``endpoint=``); it downloads over plain HTTP since no Xet header is ever sent.

Endpoints (the ones huggingface_hub 2.4 and transformers 5 call to download a model):

- ``HEAD``/``GET /{repo_id}/resolve/{revision}/{filename}``: the file, with ``X-Repo-Commit``, ``ETag`` (the
  sha256 for LFS-like files such as ``*.safetensors``, the git blob sha1 otherwise, as the Hub does),
  ``Content-Length`` and ``Accept-Ranges``; ``GET`` honours ``Range: bytes=N-[M]`` (206, used to resume);
- ``GET /api/models/{repo_id}`` and ``/api/models/{repo_id}/revision/{revision}``: model info JSON with ``sha``
  and ``siblings`` (``?blobs=true`` adds sizes and LFS info);
- ``GET /api/models/{repo_id}/tree/{revision}[/{folder}]`` (``?recursive=true``): the tree listing JSON.

Any other path gets a 404, e.g. ``GET /api/agent-harnesses``, which huggingface_hub fetches once per process
(when it first builds its User-Agent, unless its cached copy under ``HF_HOME`` is fresh); it copes with the 404.

Errors carry the Hub's ``X-Error-Code`` header, which huggingface_hub maps to its exception types: ``EntryNotFound``
(404) for a missing file or folder, ``RevisionNotFound`` (404) for another revision, and ``RepoNotFound`` for an
unknown repo (401 without a token, 404 with one, like the Hub). With ``token=`` set, a request without the header
``Authorization: Bearer <token>`` gets 401 ``RepoNotFound``, as a private repo does.
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

COMMIT = "c0ffee0123456789abcdef0123456789abcdef01"
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".onnx", ".msgpack")
LFS_MIN_SIZE = 10 * 1024 * 1024  # the Hub stores big files in LFS whatever their name

_REPO = r"(?P<repo>[^/]+(?:/[^/]+)?)"
_API = re.compile(rf"/api/models/{_REPO}(?:/(?P<kind>revision|tree)/(?P<rev>[^/]+)(?P<sub>/.*)?)?")
_RESOLVE = re.compile(rf"/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<file>.+)")


@functools.lru_cache(maxsize=256)
def _hashes(path: Path, mtime_ns: int, size: int) -> tuple[str, str]:
    """``(git blob sha1, sha256)`` of a file; the key holds mtime and size so a rewritten file is hashed again."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % size + data).hexdigest(), hashlib.sha256(data).hexdigest()


class LocalHub:
    """Serve ``repos`` (repo id -> folder of files) on ``127.0.0.1`` at a free port, in a daemon thread."""

    def __init__(self, repos: dict[str, Path], token: str | None = None):
        self.repos = {repo_id: Path(folder) for repo_id, folder in repos.items()}
        self.token = token
        self.requests: list[tuple[str, str]] = []  # (method, path with query) of every request, in order
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "LocalHub is not started; use it as a context manager"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> LocalHub:
        handler = type("Handler", (_Handler,), {"hub": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="LocalHub", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        assert self._server is not None and self._thread is not None
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def files(self, repo_id: str) -> list[str]:
        """The repo's files, as sorted posix paths relative to its folder."""
        root = self.repos[repo_id]
        return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())

    def entry(self, repo_id: str, filename: str) -> dict:
        """The tree entry of one file, in the Hub's format (``lfs`` only for LFS-like files)."""
        path = self.repos[repo_id] / filename
        st = path.stat()
        sha1, sha256 = _hashes(path, st.st_mtime_ns, st.st_size)
        out = {"type": "file", "oid": sha1, "size": st.st_size, "path": filename}
        if filename.endswith(LFS_SUFFIXES) or st.st_size >= LFS_MIN_SIZE:
            out["lfs"] = {"oid": sha256, "size": st.st_size, "pointerSize": 134}
        return out


class _Handler(BaseHTTPRequestHandler):
    """Answers one request per connection (HTTP/1.0), so no kept-alive connection outlives the server."""

    hub: LocalHub  # set on the subclass that LocalHub.__enter__ makes

    def log_message(self, format, *args) -> None:  # quiet: the requests are in hub.requests
        pass

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def do_GET(self) -> None:
        self._answer(head=False)

    def _send(self, status: int, headers: dict[str, str], body: bytes = b"", head: bool = False) -> None:
        self.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(name, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str, head: bool) -> None:
        body = json.dumps({"error": message}).encode()
        headers = {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": message}
        if code in ("EntryNotFound", "RevisionNotFound"):
            headers["X-Repo-Commit"] = COMMIT  # lets huggingface_hub cache the absence under .no_exist/<sha>
        self._send(status, headers, body, head)

    def _answer(self, head: bool) -> None:
        hub = self.hub
        hub.requests.append((self.command, self.path))
        split = urlsplit(self.path)
        auth = self.headers.get("Authorization")
        if hub.token is not None and auth != f"Bearer {hub.token}":
            return self._error(401, "RepoNotFound", "Invalid username or password.", head)
        match = _API.fullmatch(split.path) or _RESOLVE.fullmatch(split.path)
        if match is None:
            return self._error(404, "NotFound", f"no such endpoint: {split.path}", head)
        parts = {k: unquote(v) if v else v for k, v in match.groupdict().items()}
        repo_id, rev = parts["repo"], parts.get("rev")
        if repo_id not in hub.repos:
            return self._error(404 if auth else 401, "RepoNotFound", "Repository not found", head)
        if rev is not None and rev not in ("main", COMMIT):
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
        query = parse_qs(split.query)
        if "file" in parts:
            return self._file(repo_id, parts["file"], head)
        if parts["kind"] == "tree":
            return self._tree(repo_id, (parts["sub"] or "/").strip("/"), query, head)
        siblings = [{"rfilename": f} for f in hub.files(repo_id)]
        if query.get("blobs", ["false"])[0].lower() == "true":
            for sibling in siblings:
                e = hub.entry(repo_id, sibling["rfilename"])
                sibling.update(size=e["size"], blobId=e["oid"])
                if "lfs" in e:
                    sibling["lfs"] = {"size": e["size"], "sha256": e["lfs"]["oid"], "pointerSize": 134}
        info = {"_id": repo_id, "id": repo_id, "modelId": repo_id, "sha": COMMIT, "private": hub.token is not None,
                "gated": False, "disabled": False, "tags": [], "library_name": "transformers", "siblings": siblings}
        self._send(200, {"Content-Type": "application/json"}, json.dumps(info).encode(), head)

    def _tree(self, repo_id: str, folder: str, query: dict, head: bool) -> None:
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        prefix = f"{folder}/" if folder else ""
        below = [f for f in self.hub.files(repo_id) if f.startswith(prefix)]
        if folder and not below:
            return self._error(404, "EntryNotFound", f"{folder} does not exist on {COMMIT}", head)
        out, dirs = [], set()
        for f in below:
            rest = f[len(prefix):].split("/")
            for depth in range(1, len(rest) if recursive else min(2, len(rest))):
                dirs.add(prefix + "/".join(rest[:depth]))
            if recursive or len(rest) == 1:
                out.append(self.hub.entry(repo_id, f))
        out += [{"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d}
                for d in sorted(dirs)]
        self._send(200, {"Content-Type": "application/json"}, json.dumps(out).encode(), head)

    def _file(self, repo_id: str, filename: str, head: bool) -> None:
        path = self.hub.repos[repo_id] / filename
        if filename.startswith("/") or ".." in filename.split("/") or not path.is_file():  # nothing outside the repo
            return self._error(404, "EntryNotFound", f"{filename} does not exist on {COMMIT}", head)
        entry = self.hub.entry(repo_id, filename)
        etag = entry["lfs"]["oid"] if "lfs" in entry else entry["oid"]
        size = entry["size"]
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{etag}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        start, end, status = 0, size - 1, 200
        byte_range = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", "")) if not head else None
        if byte_range:
            start, end, status = int(byte_range[1]), min(int(byte_range[2] or end), end), 206
            if start > end:
                headers["Content-Range"] = f"bytes */{size}"
                return self._send(416, headers)
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        if head:
            return self._send(200, {**headers, "Content-Length": str(size)}, head=True)
        with path.open("rb") as fh:
            fh.seek(start)
            self._send(status, headers, fh.read(end - start + 1))


def use_hub(monkeypatch, tmp_path: Path, hub: LocalHub) -> str:
    """Point huggingface_hub and transformers at ``hub``, with a fresh cache under ``tmp_path``; the cache dir.

    huggingface_hub 2.4 reads its environment once, at import (``huggingface_hub/constants.py``): ``HF_ENDPOINT``
    becomes ``constants.ENDPOINT`` and ``constants.HUGGINGFACE_CO_URL_TEMPLATE`` (the ``/resolve/`` URL that
    ``hf_hub_download`` formats), ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE`` become ``constants.HF_HUB_OFFLINE``
    (which ``is_offline_mode()`` returns, for both libraries), ``HF_HOME`` the cache and token paths. So setting the
    variables now changes nothing; the constants are patched instead (the env too, for what reads it later).
    tests/conftest.py sets ``HF_HUB_OFFLINE=1`` before the import, so offline mode is switched off here. An
    ``HfApi`` copies ``constants.ENDPOINT`` when built: huggingface_hub's module-level ``api`` (behind
    ``huggingface_hub.model_info`` and friends) is re-pointed, and transformers' lazily built shared instance
    (``transformers.utils.hub._hf_api``) is dropped so that it is built again with the patched endpoint.
    """
    import huggingface_hub
    import transformers.utils.hub
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "token"))  # no stored token of the machine's
    monkeypatch.setattr(huggingface_hub.hf_api.api, "endpoint", hub.url)
    monkeypatch.setattr(transformers.utils.hub, "_hf_api", None)
    return str(cache)
