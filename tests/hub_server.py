"""A Hugging Face Hub stand-in on 127.0.0.1 for the upload tests.

No maintained package serves the Hub's write API locally (hf-local-hub needs a separate server
binary, olah only mirrors downloads), so this is a small stdlib server limited to the endpoints
the real clients use to create a repo, commit to it and download from it, as
shared/specs/hub.md measured them for huggingface_hub 0.23 to 2.x and timm:

    POST /api/repos/create                            409 carries "url", like the Hub's
    POST /api/validate-yaml                           the README's front matter must parse
    POST /api/models/{repo}/preupload/{rev}           LFS for weights files, regular otherwise
    POST /api/models/{repo}/branch/{branch}
    POST /{repo}.git/info/lfs/objects/batch           pre-signed upload URLs on another origin
    PUT  <cdn>/lfs/{oid}                              no credentials; sha256 and size checked
    POST /api/lfs-verify/{repo}
    POST /api/models/{repo}/commit/{rev}              ndjson: header, file, lfsFile, deletedFile
    HEAD|GET /{repo}/resolve/{rev}/{path}             X-Repo-Commit, ETag; LFS files 302 to cdn
    HEAD|GET <cdn>/lfs/{oid}                          no credentials
    GET  /api/models/{repo}[/revision/{rev}]          repo info (id, sha, siblings)

Writes need ``Authorization: Bearer <token>``; reads of a private repo too. Errors carry
``X-Error-Code`` (RepoNotFound, RevisionNotFound, EntryNotFound) as the Hub's do. The CDN is a
second server on another port (another origin): the clients must send it no token.

Usage (the server runs in threads of the test process; clients run in subprocesses, since
huggingface_hub reads ``HF_ENDPOINT`` when it is imported)::

    with HubServer(token="hf_test") as hub:
        env = hub.client_env(hf_home)         # HF_ENDPOINT, HF_TOKEN, HF_HUB_DISABLE_XET, ...
        subprocess.run([...], env=env)
        hub.files("org/name")                 # path -> bytes at the head of main
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Optional, Tuple
from urllib.parse import unquote, urlsplit

import yaml

_LFS_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt", ".ckpt", ".msgpack", ".tar")
_LFS_MIN_SIZE = 10 * 1024 * 1024  # the Hub stores larger files in LFS whatever their name


def _git_blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    private: bool
    commits: Dict[str, Dict[str, Tuple[str, str]]]  # commit -> path -> ("regular" | "lfs", key)
    branches: Dict[str, str] = field(default_factory=dict)  # branch -> commit


class HubServer:
    """The Hub API at ``endpoint`` and its LFS storage at another origin (see the module)."""

    def __init__(self, token: str = "hf_attnzoo_test"):
        self.token = token
        self.repos: Dict[str, Repo] = {}
        self.blobs: Dict[str, bytes] = {}   # git sha1 (regular files) or sha256 (LFS) -> bytes
        self.requests: List[Tuple[str, str, bool]] = []  # (method, path, sent a token)
        self._lock = threading.Lock()
        self._servers = [ThreadingHTTPServer(("127.0.0.1", 0), self._handler(cdn))
                         for cdn in (False, True)]
        self.endpoint, self.cdn = (f"http://127.0.0.1:{s.server_address[1]}"
                                   for s in self._servers)

    # -- life cycle ----------------------------------------------------------------------------
    def __enter__(self) -> "HubServer":
        for server in self._servers:
            threading.Thread(target=server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()

    def client_env(self, hf_home: os.PathLike, token: Optional[str] = None) -> Dict[str, str]:
        """The environment of a client process talking to this server, with its own cache."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("HF_", "HUGGING_FACE_")) and k != "TRANSFORMERS_OFFLINE"}
        env.update(HF_ENDPOINT=self.endpoint, HF_HOME=os.fspath(hf_home),
                   HF_TOKEN=self.token if token is None else token,
                   HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1")
        return env

    # -- state the tests read ------------------------------------------------------------------
    def files(self, repo_id: str, revision: str = "main") -> Dict[str, bytes]:
        """Every file of ``repo_id`` at ``revision``, as the server stores it."""
        repo = self.repos[repo_id]
        tree = repo.commits[repo.branches[revision]]
        return {path: self.blobs[key] for path, (_, key) in tree.items()}

    # -- the handler ---------------------------------------------------------------------------
    def _handler(self, cdn: bool):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet: the tests read hub.requests
                pass

            def do_HEAD(self):
                hub._dispatch(self, cdn)

            do_GET = do_POST = do_PUT = do_HEAD

        return Handler

    def _dispatch(self, h: BaseHTTPRequestHandler, cdn: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        authorized = h.headers.get("Authorization") == f"Bearer {self.token}"
        with self._lock:
            self.requests.append((h.command, ("cdn:" if cdn else "") + path,
                                  "Authorization" in h.headers))
        try:
            body = _read_body(h)
            if cdn:
                return self._cdn(h, path, body)
            for method, pattern, fn in self._routes():
                m = re.fullmatch(pattern, path)
                if m and h.command in method:
                    writes = h.command in ("POST", "PUT") and fn != self._validate_yaml
                    if writes and not authorized:
                        return _send(h, 401, {"error": "Invalid credentials in Authorization "
                                                       "header"})
                    return fn(h, authorized, body, *m.groups())
            _send(h, 404, {"error": f"no route {h.command} {path}"})
        except _HubError as e:
            _send(h, e.status, {"error": e.message},
                  {"X-Error-Code": e.code, "X-Error-Message": e.message, **e.headers})

    def _routes(self):
        repo = r"([\w.-]+/[\w.-]+)"
        return [
            (("POST",), r"/api/repos/create", self._create),
            (("POST",), r"/api/validate-yaml", self._validate_yaml),
            (("POST",), rf"/api/models/{repo}/preupload/(.+)", self._preupload),
            (("POST",), rf"/api/models/{repo}/branch/(.+)", self._branch),
            (("POST",), rf"/api/models/{repo}/commit/(.+)", self._commit),
            (("POST",), rf"/{repo}\.git/info/lfs/objects/batch", self._lfs_batch),
            (("POST",), rf"/api/lfs-verify/{repo}", self._lfs_verify),
            (("GET",), rf"/api/models/{repo}(?:/revision/(.+))?", self._info),
            (("HEAD", "GET"), rf"/{repo}/resolve/([^/]+)/(.+)", self._resolve),
        ]

    def _repo(self, repo_id: str, authorized: bool) -> Repo:
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and not authorized):
            raise _HubError(401, "RepoNotFound", f"Repository Not Found for url: {repo_id}")
        return repo

    def _commit_of(self, repo: Repo, revision: str) -> str:
        if revision in repo.branches:
            return repo.branches[revision]
        if revision in repo.commits:
            return revision
        raise _HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")

    # -- API -----------------------------------------------------------------------------------
    def _create(self, h, authorized, body):
        spec = json.loads(body)
        repo_id = f"{spec['organization']}/{spec['name']}"
        url = f"{self.endpoint}/{repo_id}"
        with self._lock:
            if repo_id in self.repos:
                return _send(h, 409, {"error": "You already created this model repo",
                                      "url": url})
            private = bool(spec.get("private")) or spec.get("visibility") == "private"
            attributes = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
            self.blobs[_git_blob_sha(attributes)] = attributes
            first = hashlib.sha1(f"init {repo_id}".encode()).hexdigest()
            self.repos[repo_id] = Repo(private, {first: {
                ".gitattributes": ("regular", _git_blob_sha(attributes))}}, {"main": first})
        _send(h, 200, {"url": url})

    def _validate_yaml(self, h, authorized, body):
        text = json.loads(body)["content"]
        m = re.match(r"---\n(.*?)\n---\n", text, re.S)
        errors = []
        try:
            if m is not None and not isinstance(yaml.safe_load(m.group(1)), dict):
                errors.append({"message": "the front matter is not a mapping"})
        except yaml.YAMLError as e:
            errors.append({"message": f"invalid YAML: {e}"})
        _send(h, 400 if errors else 200, {"errors": errors, "warnings": []})

    def _preupload(self, h, authorized, body, repo_id, revision):
        repo = self._repo(repo_id, authorized)
        self._commit_of(repo, unquote(revision))
        files = [{"path": f["path"], "shouldIgnore": False,
                  "uploadMode": "lfs" if f["path"].endswith(_LFS_SUFFIXES)
                  or f["size"] >= _LFS_MIN_SIZE else "regular"}
                 for f in json.loads(body)["files"]]
        _send(h, 200, {"files": files})

    def _branch(self, h, authorized, body, repo_id, branch):
        repo = self._repo(repo_id, authorized)
        start = (json.loads(body) if body else {}).get("startingPoint") or "main"
        with self._lock:
            if branch in repo.branches:
                return _send(h, 409, {"error": f"Reference already exists: {branch}"})
            repo.branches[branch] = self._commit_of(repo, start)
        _send(h, 200, {})

    def _lfs_batch(self, h, authorized, body, repo_id):
        self._repo(repo_id, authorized)
        objects = []
        for obj in json.loads(body)["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"]}
            if obj["oid"] not in self.blobs:  # stored objects get no actions: skipped
                entry["actions"] = {
                    "upload": {"href": f"{self.cdn}/lfs/{obj['oid']}?signature=test"},
                    "verify": {"href": f"{self.endpoint}/api/lfs-verify/{repo_id}"}}
            objects.append(entry)
        _send(h, 200, {"transfer": "basic", "objects": objects},
              content_type="application/vnd.git-lfs+json")

    def _lfs_verify(self, h, authorized, body, repo_id):
        obj = json.loads(body)
        data = self.blobs.get(obj["oid"])
        if data is None or len(data) != obj["size"]:
            raise _HubError(404, "EntryNotFound", f"LFS object {obj['oid']} not uploaded")
        _send(h, 200, {})

    def _commit(self, h, authorized, body, repo_id, revision):
        repo = self._repo(repo_id, authorized)
        revision = unquote(revision)
        with self._lock:
            parent = self._commit_of(repo, revision)
            tree = dict(repo.commits[parent])
            for line in body.decode().splitlines():
                item = json.loads(line)
                value = item["value"]
                if item["key"] == "file":
                    data = base64.b64decode(value["content"])
                    self.blobs[_git_blob_sha(data)] = data
                    tree[value["path"]] = ("regular", _git_blob_sha(data))
                elif item["key"] == "lfsFile":
                    if value["oid"] not in self.blobs:
                        raise _HubError(400, "BadRequest", f"LFS object {value['oid']} missing")
                    tree[value["path"]] = ("lfs", value["oid"])
                elif item["key"] == "deletedFile":
                    tree.pop(value["path"], None)
            commit = hashlib.sha1(json.dumps([parent, sorted(tree.items())]).encode()
                                  + str(len(repo.commits)).encode()).hexdigest()
            repo.commits[commit] = tree
            repo.branches[revision] = commit
        _send(h, 200, {"commitUrl": f"{self.endpoint}/{repo_id}/commit/{commit}",
                       "commitOid": commit})

    def _info(self, h, authorized, body, repo_id, revision):
        repo = self._repo(repo_id, authorized)
        commit = self._commit_of(repo, unquote(revision or "main"))
        _send(h, 200, {"id": repo_id, "modelId": repo_id, "sha": commit, "private": repo.private,
                       "xetEnabled": False,
                       "siblings": [{"rfilename": p} for p in sorted(repo.commits[commit])]})

    def _resolve(self, h, authorized, body, repo_id, revision, filename):
        repo = self._repo(repo_id, authorized)
        commit = self._commit_of(repo, revision)
        entry = repo.commits[commit].get(filename)
        if entry is None:
            raise _HubError(404, "EntryNotFound", f"{filename} does not exist at {revision}",
                            {"X-Repo-Commit": commit})
        kind, key = entry
        data = self.blobs[key]
        if kind == "lfs":
            return _send(h, 302, b"", {
                "Location": f"{self.cdn}/lfs/{key}", "X-Repo-Commit": commit,
                "X-Linked-Etag": f'"{key}"', "X-Linked-Size": str(len(data)),
                "ETag": f'"{_git_blob_sha(data)}"'})
        _send(h, 200, data, {"X-Repo-Commit": commit, "ETag": f'"{key}"'},
              content_type="application/octet-stream")

    def _cdn(self, h, path, body):
        m = re.fullmatch(r"/lfs/([0-9a-f]{64})", path)
        if m is None:
            return _send(h, 404, {"error": "no such object"})
        oid = m.group(1)
        if h.command == "PUT":
            if hashlib.sha256(body).hexdigest() != oid:
                return _send(h, 400, {"error": "sha256 mismatch"})
            with self._lock:
                self.blobs[oid] = body
            return _send(h, 200, b"")
        if oid not in self.blobs:
            return _send(h, 404, {"error": "no such object"})
        _send(h, 200, self.blobs[oid], {"ETag": f'"{oid}"'},
              content_type="application/octet-stream")


class _HubError(Exception):
    def __init__(self, status: int, code: str, message: str, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers or {}


def _read_body(h: BaseHTTPRequestHandler) -> bytes:
    if "chunked" in h.headers.get("Transfer-Encoding", ""):
        chunks = []
        while True:
            size = int(h.rfile.readline().split(b";")[0].strip(), 16)
            if size == 0:
                h.rfile.readline()
                return b"".join(chunks)
            chunks.append(h.rfile.read(size))
            h.rfile.readline()
    return h.rfile.read(int(h.headers.get("Content-Length") or 0))


def _send(h: BaseHTTPRequestHandler, status: int, payload, headers: Optional[dict] = None,
          content_type: str = "application/json") -> None:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    h.send_response(status)
    h.send_header("Content-Type", content_type)
    h.send_header("Content-Length", str(len(data)))
    for k, v in (headers or {}).items():
        h.send_header(k, v)
    h.end_headers()
    if h.command != "HEAD":
        h.wfile.write(data)
