"""Drive Open WebUI's chat page in a headless Chromium, as a person would (see README.md here).

Uses the machine's own browser: Debian's ``chromium`` and its matching ``chromedriver``
(``apt-get install chromium chromium-driver``), driven by ``selenium`` from PyPI. Nothing is
downloaded: the driver and browser paths are given, so Selenium Manager is never asked.
``$CONTEXTWARDEN_CHROMIUM`` / ``$CONTEXTWARDEN_CHROMEDRIVER`` point at others.

The page facts used here were read from Open WebUI 0.12.4's frontend source (its source maps):
the token lives in ``localStorage.token``; ``/?models=<id>`` opens a new chat with that model;
``#chat-input`` is the message box (a contenteditable); each reply is a ``.chat-assistant``
with its text in ``#response-content-container``; the one status line shown is the LAST status
of the reply, in the ``button[aria-label="Toggle status history"]`` that expands the others.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "Reply",
    "chat_page",
    "expand_status",
    "find_browser",
    "open_chat",
    "read_replies",
    "send",
    "start_chromium",
    "wait_for_replies",
]

CHROMIUM_ENV, CHROMEDRIVER_ENV = "CONTEXTWARDEN_CHROMIUM", "CONTEXTWARDEN_CHROMEDRIVER"
WINDOW = (1280, 900)
PAGE_TIMEOUT_S = 60.0
REPLY_TIMEOUT_S = 120.0  # a reply on 2 loaded cores; the filter and Open WebUI's tasks run too
TOGGLE = 'button[aria-label="Toggle status history"]'

_READ_REPLIES = f"""
return Array.from(document.querySelectorAll('.chat-assistant')).map(reply => {{
  const toggle = reply.querySelector('{TOGGLE}');
  const content = reply.querySelector('#response-content-container');
  return {{
    shown: toggle ? (toggle.querySelector('.status-description')?.innerText ?? '').trim() : null,
    lines: Array.from(reply.querySelectorAll('.status-description')).map(e => e.innerText.trim()),
    expanded: toggle ? toggle.getAttribute('aria-expanded') === 'true' : false,
    text: content ? content.innerText.trim() : '',
  }};
}});
"""


@dataclass(frozen=True)
class Reply:
    """One assistant reply as the page shows it: the status line in view, every status line in
    the DOM (the whole history once expanded), and the reply's text."""

    shown: str | None
    lines: list[str]
    expanded: bool
    text: str


def find_browser() -> tuple[str, str] | str:
    """``(chromium, chromedriver)`` paths, or why they cannot be used (a sentence)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    chromium = _executable(CHROMIUM_ENV, "chromium", "chromium-browser")
    driver = _executable(CHROMEDRIVER_ENV, "chromedriver")
    if not chromium or not driver:
        missing = " and ".join(name for name, path in (("chromium", chromium), ("chromedriver", driver)) if not path)
        return f"no {missing} (apt-get install chromium chromium-driver, or set ${CHROMIUM_ENV} / ${CHROMEDRIVER_ENV})"
    return chromium, driver


def _executable(variable: str, *names: str) -> str | None:
    """``$variable`` when set (and executable), else the first of ``names`` on PATH."""
    configured = os.environ.get(variable)
    if configured:
        return configured if os.access(configured, os.X_OK) and Path(configured).is_file() else None
    return next((path for name in names if (path := shutil.which(name))), None)


def start_chromium(chromium: str, chromedriver: str) -> Any:
    """A headless Chromium session (``selenium.webdriver.Chrome``); the caller quits it."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=chromedriver))
    driver.set_page_load_timeout(PAGE_TIMEOUT_S)
    return driver


@contextmanager
def chat_page(chromium: str, chromedriver: str, shots: Path) -> Iterator[Any]:
    """A browser for a block; on any failure a screenshot and the page's HTML go to ``shots``
    (their paths are added to the error)."""
    driver = start_chromium(chromium, chromedriver)
    try:
        yield driver
    except BaseException as exc:
        shots.mkdir(parents=True, exist_ok=True)
        png, html = shots / "browser-failure.png", shots / "browser-failure.html"
        try:
            driver.save_screenshot(str(png))
            html.write_text(driver.page_source, "utf-8")
            exc.add_note(f"browser screenshot: {png} (page HTML: {html})")
        except Exception as shot_error:  # noqa: BLE001 - the browser may be what broke
            exc.add_note(f"no browser screenshot: {type(shot_error).__name__}: {shot_error}")
        raise
    finally:
        driver.quit()


def open_chat(driver: Any, base_url: str, token: str, model: str) -> None:
    """Sign in with ``token`` (Open WebUI's frontend keeps it in ``localStorage.token``) and open
    a new chat with ``model``; returns once the message box is there."""
    driver.get(f"{base_url}/auth")
    driver.execute_script("localStorage.setItem('token', arguments[0]);", token)
    driver.get(f"{base_url}/?models={model}")
    _wait(lambda: driver.find_elements("css selector", "#chat-input"), PAGE_TIMEOUT_S, "no #chat-input")


def send(driver: Any, text: str, *, paste: bool = False) -> None:
    """Send one message: typed key by key and sent with Enter, or (``paste``) inserted at once as
    a paste inserts it (typing 10k characters would take minutes) and sent with the button."""
    from selenium.webdriver.common.keys import Keys

    box = driver.find_element("css selector", "#chat-input")
    box.click()
    if not paste:
        box.send_keys(text, Keys.ENTER)
        return
    driver.execute_script("arguments[0].focus(); document.execCommand('insertText', false, arguments[1]);", box, text)
    _wait(lambda: text[-40:] in box.text, PAGE_TIMEOUT_S, "pasted text not in #chat-input")
    driver.find_element("css selector", "#send-message-button").click()


def read_replies(driver: Any) -> list[Reply]:
    """Every assistant reply on the page, in order."""
    return [Reply(**raw) for raw in driver.execute_script(_READ_REPLIES)]


def wait_for_replies(
    driver: Any, count: int, done: Callable[[Reply], bool], timeout: float = REPLY_TIMEOUT_S
) -> list[Reply]:
    """Wait until the page shows ``count`` replies and ``done`` holds for the last; return them."""
    replies: list[Reply] = []

    def ready() -> bool:
        nonlocal replies
        replies = read_replies(driver)
        return len(replies) == count and done(replies[-1])

    _wait(ready, timeout, lambda: f"{count} finished replies not shown; the page has {replies}")
    return replies


def expand_status(driver: Any, index: int) -> Reply:
    """Open the status history of reply ``index`` (a click, as a person would) and read it."""
    if not read_replies(driver)[index].expanded:
        toggle = driver.find_elements("css selector", ".chat-assistant")[index].find_element("css selector", TOGGLE)
        # centred, so neither the sticky header nor the message box at the bottom covers it
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", toggle)
        toggle.click()
    _wait(lambda: read_replies(driver)[index].expanded, PAGE_TIMEOUT_S, "status history did not open")
    return read_replies(driver)[index]


def _wait(condition: Callable[[], Any], timeout: float, message: str | Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(message() if callable(message) else message)
        time.sleep(0.25)
