"""Hugging Face hub ids: downloaded when online, loaded from the cache offline, one-line errors.

No network here: a local HTTP server imitates the hub's API for one repo (the endpoints
`snapshot_download` calls: /api/models/{repo}[/revision/{rev}], /api/models/{repo}/tree/{rev},
HEAD/GET /{repo}/resolve/{rev}/{file}, with X-Repo-Commit, ETag and Content-Length) and serves
the files of a saved `tiny` model; huggingface_hub's endpoint and cache are pointed at it and
at a temporary folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

torch = pytest.importorskip("torch")
hub_constants = pytest.importorskip("huggingface_hub.constants")

from mas_trainer.engines import models  # noqa: E402
from mas_trainer.engines.models import ModelNotFoundError, check_model, load_model, load_tokenizer  # noqa: E402

REPO = "test-org/tiny-chat"
GATED = "test-org/gated"
SHA = "0123456789abcdef0123456789abcdef01234567"
# files a model does not need: the fake hub serves them, the download must leave them out
EXTRA = {"onnx/model.onnx": b"not needed", "pytorch_model.bin": b"a second copy of the weights", "README.md": b"# tiny"}


class FakeHub:
    """The hub's API for one model repo (and one gated repo), on 127.0.0.1."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                self.answer(head=True)

            def do_GET(self) -> None:
                self.answer(head=False)

            def send(self, status: int, body: bytes, headers: dict[str, str], head: bool) -> None:
                self.send_response(status)
                for k, v in {"Content-Length": str(len(body)), **headers}.items():
                    self.send_header(k, v)
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def answer(self, head: bool) -> None:
                path = unquote(urlsplit(self.path).path)
                hub.requests.append((self.command, path))
                if path.startswith("/api/models/"):
                    rest = path[len("/api/models/"):]
                    repo = "/".join(rest.split("/")[:2])
                    if repo == GATED:
                        return self.send(403, b"{}", {"X-Error-Code": "GatedRepo"}, head)
                    if repo != REPO:
                        return self.send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, head)
                    if "/tree/" in rest:
                        listing = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                                   for name, data in hub.files.items()]
                        return self.send(200, json.dumps(listing).encode(), {"Content-Type": "application/json"}, head)
                    info = {"id": REPO, "sha": SHA, "private": False, "siblings": [{"rfilename": n} for n in hub.files]}
                    return self.send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head)
                prefix = f"/{REPO}/resolve/"
                if path.startswith(prefix):
                    name = path[len(prefix):].split("/", 1)[1]
                    if name in hub.files:
                        data = hub.files[name]
                        return self.send(200, data, {"X-Repo-Commit": SHA, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'},
                                         head)
                    return self.send(404, b"{}", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": SHA}, head)
                return self.send(404, b"{}", {"X-Error-Code": "RepoNotFound"}, head)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def repo_files(tmp_path_factory) -> dict[str, bytes]:
    """The files of a saved `tiny` model (weights, config, tokenizer, chat template) plus EXTRA."""
    folder = tmp_path_factory.mktemp("tiny-model")
    model, tok = load_model("tiny", seed=5)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    return {**files, **EXTRA}


def _point_hub_at(monkeypatch, endpoint: str, cache: Path, *, offline: bool) -> None:
    """What HF_ENDPOINT / HF_HUB_CACHE / HF_HUB_OFFLINE set at import do, for this process."""
    monkeypatch.setattr(hub_constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(hub_constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.setattr(models, "_hub_folders", {}, raising=False)  # downloads this process remembers


@pytest.fixture
def hub(repo_files):
    server = FakeHub(repo_files)
    yield server
    server.stop()


def _closed_port_url() -> str:
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    server.server_close()
    return url


def test_hub_id_downloads_then_loads_offline_from_the_cache(hub, repo_files, tmp_path, monkeypatch):
    home = tmp_path / "hf-home"
    _point_hub_at(monkeypatch, hub.url, home / "hub", offline=False)

    check_model(REPO)  # the driver: downloads once, checks tokenizer and chat template
    snapshot = home / "hub" / "models--test-org--tiny-chat" / "snapshots" / SHA
    assert (home / "hub" / "models--test-org--tiny-chat" / "refs" / "main").read_text() == SHA
    got = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    assert got == sorted(set(repo_files) - set(EXTRA))  # no ONNX, no second copy of the weights, no README
    assert models.materialize(REPO) == snapshot  # verl's training worker reads folders

    downloads = [r for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]]
    model, tok = load_model(REPO)  # a worker in the same process: nothing downloaded again
    assert [r for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]] == downloads
    reference, _ = load_model("tiny", seed=5)
    ids = torch.tensor([[1, 4093, 198, 6004, 2]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, reference(ids).logits)
    assert tok.eos_token_id == 2

    # HF_HUB_OFFLINE=1 and no hub at all: the cache, as a new process on this machine sees it
    hub.stop()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1", HF_ENDPOINT=_closed_port_url())
    script = (f"from mas_trainer.engines.models import check_model, load_model, load_tokenizer\n"
              f"check_model({REPO!r})\n"
              f"model, tok = load_model({REPO!r})\n"
              f"print('loaded', model.config.num_hidden_layers, load_tokenizer({REPO!r}).eos_token)\n")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "loaded 2 <|im_end|>"


def test_hub_unreachable_falls_back_to_the_cache(hub, tmp_path, monkeypatch):
    _point_hub_at(monkeypatch, hub.url, tmp_path / "hub", offline=False)
    check_model(REPO)
    _point_hub_at(monkeypatch, _closed_port_url(), tmp_path / "hub", offline=False)  # online, but no hub answers
    check_model(REPO)
    assert load_tokenizer(REPO).eos_token == "<|im_end|>"
    assert models.hub_folder(REPO) == tmp_path / "hub" / "models--test-org--tiny-chat" / "snapshots" / SHA


def _one_line(info) -> str:
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, ValueError)
    return message


def test_offline_with_an_empty_cache_is_one_line(tmp_path, monkeypatch):
    _point_hub_at(monkeypatch, _closed_port_url(), tmp_path / "empty", offline=True)
    for call in (check_model, load_model, load_tokenizer):
        with pytest.raises(ModelNotFoundError) as info:
            call(REPO)
        message = _one_line(info)
        assert REPO in message and "not in the local Hugging Face cache" in message and str(tmp_path / "empty") in message
        assert "HF_HUB_OFFLINE" in message and f"hf download {REPO}" in message


def test_offline_as_the_environment_says_now(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE set after huggingface_hub was imported (a test, a notebook) is obeyed too."""
    _point_hub_at(monkeypatch, _closed_port_url(), tmp_path / "empty", offline=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as info:
        check_model(REPO)
    assert "HF_HUB_OFFLINE is set" in _one_line(info)


def test_unreachable_hub_and_empty_cache_is_one_line(tmp_path, monkeypatch):
    endpoint = _closed_port_url()
    _point_hub_at(monkeypatch, endpoint, tmp_path / "empty", offline=False)
    with pytest.raises(ModelNotFoundError) as info:
        check_model(REPO)
    message = _one_line(info)
    assert REPO in message and "could not be reached" in message and endpoint in message and "hf download" in message


@pytest.mark.parametrize("repo, words", [("test-org/no-such-model", "neither a local folder nor a model on the Hugging Face hub"),
                                         (GATED, "is gated"),
                                         ("not a valid id!", "nor a valid Hugging Face hub id")])
def test_hub_refusals_are_one_line(hub, repo, words, tmp_path, monkeypatch):
    _point_hub_at(monkeypatch, hub.url, tmp_path / "hub", offline=False)
    with pytest.raises(ModelNotFoundError) as info:
        check_model(repo)
    message = _one_line(info)
    assert repo in message and words in message


def test_hub_cache_laid_out_by_hand_loads_offline(repo_files, tmp_path, monkeypatch):
    """The cache layout another tool (or an older huggingface_hub) leaves: refs/main and a snapshot, no tree listing."""
    storage = tmp_path / "hub" / "models--test-org--tiny-chat"
    snapshot = storage / "snapshots" / SHA
    for name, data in repo_files.items():
        if name not in EXTRA:
            (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            (snapshot / name).write_bytes(data)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(SHA)
    _point_hub_at(monkeypatch, _closed_port_url(), tmp_path / "hub", offline=True)
    check_model(REPO)
    model, tok = load_model(REPO)
    assert model.config.num_hidden_layers == 2 and tok.eos_token_id == 2
    assert models.hub_folder(REPO) == snapshot
