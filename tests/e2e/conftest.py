"""Fixtures for end-to-end tests against a real Open WebUI 0.12.4 (see README.md here).

Session-scoped: ``owui_venv`` (Path), ``fake_backend`` (FakeBackend), ``open_webui``
(OpenWebUI). Function-scoped: ``backend`` (the session FakeBackend, reset for the test).
Every test in this folder is marked ``e2e``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_backend import FakeBackend  # noqa: E402
from owui import OpenWebUI, VenvError, default_venv_path, ensure_venv, start_open_webui  # noqa: E402

_HERE = Path(__file__).resolve().parent
_TIMINGS: dict[str, float] = {}


def _skip_requested() -> bool:
    """Local opt-out: CONTEXTWARDEN_SKIP_E2E=1, never honoured when CI is set."""
    return os.environ.get("CONTEXTWARDEN_SKIP_E2E") == "1" and not os.environ.get("CI")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test under tests/e2e as ``e2e``."""
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.e2e)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print how long the e2e set-up took (venv, server start)."""
    if _TIMINGS:
        text = ", ".join(f"{key} {value:.1f} s" for key, value in _TIMINGS.items())
        terminalreporter.write_line(f"contextwarden e2e timings: {text}")


@pytest.fixture(scope="session")
def owui_venv() -> Path:
    """A venv holding open-webui 0.12.4 (created on first use; see owui.ensure_venv).

    Fails when it cannot be made; skips only with CONTEXTWARDEN_SKIP_E2E=1 and no CI.
    """
    if _skip_requested():
        pytest.skip("CONTEXTWARDEN_SKIP_E2E=1: Open WebUI end-to-end tests skipped on request")
    started = time.monotonic()
    try:
        venv = ensure_venv(default_venv_path())
    except (VenvError, OSError) as exc:
        pytest.fail(f"cannot create the Open WebUI {default_venv_path()} venv: {exc}", pytrace=False)
    _TIMINGS["venv_s"] = time.monotonic() - started
    return venv


@pytest.fixture(scope="session")
def fake_backend() -> Iterator[FakeBackend]:
    """The session's OpenAI-compatible fake backend (Open WebUI points at it)."""
    backend = FakeBackend().start()
    try:
        yield backend
    finally:
        backend.stop()


@pytest.fixture
def backend(fake_backend: FakeBackend) -> FakeBackend:
    """The session backend with recorded requests and queued replies cleared for this test."""
    fake_backend.reset()
    return fake_backend


@pytest.fixture(scope="session")
def open_webui(
    owui_venv: Path, fake_backend: FakeBackend, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OpenWebUI]:
    """One Open WebUI per session, offline on loopback, admin signed up, stopped at the end."""
    workdir = tmp_path_factory.mktemp("open-webui")
    owui = start_open_webui(owui_venv, fake_backend, workdir)
    _TIMINGS["server_start_s"] = owui.timings["ready_s"]
    try:
        yield owui
    finally:
        owui.stop()
