"""The `contextwarden` command on the example chat."""

from __future__ import annotations

import http.server
import json
import re
import socket
import socketserver
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from contextwarden.tools.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "long_chat.json"


def test_trim_table(capsys):
    assert main(["trim", str(EXAMPLE), "--max-tokens", "2000"]) == 0
    out = capsys.readouterr().out
    assert "dropped" in out and "kept" in out
    assert "tokens (budget 2,000, exact counts)" in out


def test_trim_json_is_consistent(capsys):
    assert main(["trim", str(EXAMPLE), "--max-tokens", "2000", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    chat = json.loads(EXAMPLE.read_text())
    total = len(chat["messages"])
    assert sorted(data["kept"] + data["dropped"] + data["shortened"]) == list(range(total))
    assert data["tokens_after"] <= 2000 < data["tokens_before"]
    assert data["messages"][-1] == chat["messages"][-1]


def test_trim_strategy_recent_keeps_the_newest_turns(capsys):
    assert main(["trim", str(EXAMPLE), "--max-tokens", "2000", "--json", "--strategy", "recent"]) == 0
    data = json.loads(capsys.readouterr().out)
    chat = json.loads(EXAMPLE.read_text())["messages"]
    history = [i for i in data["kept"] if chat[i]["role"] != "system"]
    assert data["dropped"] and max(data["dropped"]) < min(history)
    assert main(["trim", str(EXAMPLE), "--max-tokens", "2000", "--strategy", "recent", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "among the newest turns that fit" in out and "score:" not in out


def test_trim_rejects_bad_input(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["trim", str(bad), "--max-tokens", "100"]) == 2
    assert "contextwarden:" in capsys.readouterr().err


def test_build_check_via_command():
    run = subprocess.run(
        [sys.executable, "-m", "contextwarden.tools.cli", "build", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert "up to date" in run.stdout


def _trim_error(tmp_path, capsys, text: str | None, *extra: str) -> str:
    """The error line of `trim` on a chat file holding `text` (None: the example chat)."""
    path = EXAMPLE
    if text is not None:
        path = tmp_path / "chat.json"
        path.write_text(text)
    assert main(["trim", str(path), "--max-tokens", "2000", *extra]) == 2
    return capsys.readouterr().err


def test_trim_names_the_file_and_the_line_of_invalid_json(tmp_path, capsys):
    err = _trim_error(tmp_path, capsys, '{"messages": [\n  {"role": "user",}\n]}')
    assert "chat.json" in err and "line 2" in err and "Traceback" not in err


def test_trim_refuses_a_file_without_messages(tmp_path, capsys):
    assert 'no "messages" list' in _trim_error(tmp_path, capsys, '{"foo": 1}')
    assert "a list of messages" in _trim_error(tmp_path, capsys, "null")
    assert "message 1 is a number, not an object" in _trim_error(
        tmp_path, capsys, '[{"role": "user", "content": "hi"}, 3]'
    )


def test_trim_names_the_option_that_is_wrong(tmp_path, capsys):
    assert "--calibration" in _trim_error(tmp_path, capsys, None, "--calibration", "-1")
    assert "--calibration" in _trim_error(tmp_path, capsys, None, "--calibration", "0")
    err = _trim_error(tmp_path, capsys, None, "--pin", "99")
    assert "--pin 99" in err and "22 messages" in err
    assert "--keep-last-turns" in _trim_error(tmp_path, capsys, None, "--keep-last-turns", "0")
    err = _trim_error(tmp_path, capsys, None, "--reserve", "2000")
    assert "--reserve 2000" in err


def test_calibration_is_applied_as_the_filter_applies_it(capsys):
    """Before: the budget was divided by the raw factor: --calibration 0.5 budgeted 2,400 in a
    1,200-token window (and sent 2,054 tokens), 2.0 budgeted 600. The filter bounds the effect to
    0.8-1.5 and never budgets past the window (`calibration.calibrated_budget`)."""
    budgets = {}
    for factor in ("0.5", "2.0"):
        assert main(["trim", str(EXAMPLE), "--max-tokens", "1200", "--calibration", factor, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        budgets[factor] = data["budget"]
        assert data["tokens_after"] <= 1200
    assert budgets == {"0.5": 1200, "2.0": 800}
    assert main(["trim", str(EXAMPLE), "--max-tokens", "1200", "--calibration", "2", "--explain"]) == 0
    assert "budget 800 = window 1,200, ÷ calibration 1.5" in capsys.readouterr().out


def test_version_flag(capsys):
    import contextwarden

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"contextwarden {contextwarden.__version__}"


def _usage_error(port: int) -> str:
    """The stderr of `contextwarden usage` pointed at a local port (a process of its own, so a
    hang at its exit shows as a timeout); asserts it failed with one line and no traceback."""
    run = subprocess.run(
        [sys.executable, "-m", "contextwarden.tools.cli", "usage", "--redis-url", f"redis://127.0.0.1:{port}/0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines() == [run.stderr.strip()] and run.stderr.startswith("contextwarden usage:")
    assert "Traceback" not in run.stderr and f"127.0.0.1:{port}" in run.stderr
    return run.stderr


def test_usage_against_a_dead_redis_prints_one_line(tmp_path):
    """The command's own message only: no library warning leaks through logging's last resort."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    assert "connection refused" in _usage_error(port).lower()


class _NotRedis(socketserver.BaseRequestHandler):
    """Reads what the client sends and answers what a web server (or worse) would."""

    answer = b""

    def handle(self) -> None:
        self.request.recv(65_536)
        self.request.sendall(self.answer)


class _WebServer(_NotRedis):
    answer = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class _Garbage(_NotRedis):
    answer = b"\x00\xffgarbage\r\n"


NOT_REDIS = {  # the server, and what the one line says of it
    "http/1.1": (_WebServer, "is not Redis (it answered Protocol Error: b'HTTP/1.1 400 Bad Request')"),
    "garbage": (_Garbage, "is not Redis (it answered Protocol Error:"),
    "python http.server": (http.server.BaseHTTPRequestHandler, "gave no Redis answer"),  # HTML, no status line
}


@pytest.fixture(params=list(NOT_REDIS))
def not_redis(request) -> Iterator[tuple[int, str]]:
    """A local server that is not Redis: its port, and what the command should say of it."""
    handler, said = NOT_REDIS[request.param]
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler) as server:
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        yield server.server_address[1], said
        server.shutdown()
        thread.join()


def test_usage_against_a_server_that_is_not_redis_prints_one_line(not_redis):
    """A 70-line traceback (redis' InvalidResponse) before, and at times a hang at exit."""
    port, said = not_redis
    err = _usage_error(port)
    assert f"127.0.0.1:{port} {said}" in err and "redis_url valve" in err
    if "HTTP/1.1" in said:  # the README quotes this one, on port 8080
        assert err.replace(str(port), "8080") in (ROOT / "README.md").read_text("utf-8")


def test_trim_refuses_a_chat_over_the_size_limit_and_says_how_to_lift_it(tmp_path, capsys):
    """A 10 MB chat took a minute to trim with no word of it: it is refused unless asked for."""
    words = " ".join(f"word{i}" for i in range(250_000))  # about 2.6 MB
    text = json.dumps([{"role": "user", "content": words}])
    err = _trim_error(tmp_path, capsys, text, "--max-input-mb", "1")
    assert "chat.json: 2.6 MB, over the --max-input-mb limit of 1 MB" in err and "--max-input-mb 0" in err
    assert main(["trim", str(tmp_path / "chat.json"), "--max-tokens", "2000", "--max-input-mb", "0", "--json"]) == 0


def test_a_long_trim_shows_its_time_on_a_terminal_only(tmp_path, monkeypatch):
    """Elapsed time on stderr while a trim runs past a second, and only when stderr is a terminal."""
    import io
    import time

    import contextwarden.tools.cli as cli

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(cli, "PROGRESS_AFTER_SECONDS", 0.0)
    for stream, shown in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stream)
        with cli._progress("trimming 3 messages"):
            time.sleep(0.7)
        assert ("contextwarden: trimming 3 messages… " in stream.getvalue()) is shown


def test_usage_against_a_silent_server_says_how_long_it_waited(monkeypatch, capsys):
    """A server that takes the connection and never answers: named, with the wait, in one line."""
    import contextwarden.tools.cli as cli

    monkeypatch.setattr(cli, "USAGE_REDIS_TIMEOUT", 0.1)  # an answer may take 4 times it
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        assert main(["usage", "--redis-url", f"redis://127.0.0.1:{port}/0"]) == 2
    err = capsys.readouterr().err
    said = rf"contextwarden usage: Redis at 127.0.0.1:{port} did not answer \(gave up after \d+ s\)\n"
    assert re.fullmatch(said, err)


# -- what `trim` and `usage` say of input they cannot use (issue 31) ----------------------------

BODY = {
    "model": "gpt-4o",
    "stream": True,
    "temperature": 0.2,
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a fjord?"}],
}


def test_trim_takes_a_request_body_from_a_file_or_given_as_the_argument(tmp_path, capsys):
    """A request body (model, stream, ...) gives its messages; the JSON itself in place of a path
    said `[Errno 2] No such file or directory: '{"model": ...'`."""
    path = tmp_path / "body.json"
    path.write_text(json.dumps(BODY))
    for chat in (str(path), json.dumps(BODY)):
        assert main(["trim", chat, "--max-tokens", "2000", "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["model"] == "gpt-4o" and data["messages"] == BODY["messages"]


def test_trim_says_what_it_expected_of_a_string(tmp_path, capsys):
    """A chat encoded twice (a JSON string holding JSON), messages as a string, or a path that is
    not there: named, with what was expected."""
    expected = 'expected a list of messages or a request body {"messages": [...]}'
    err = _trim_error(tmp_path, capsys, json.dumps(json.dumps(BODY)))
    assert (
        err == f"contextwarden: {tmp_path / 'chat.json'}: a JSON string, not a chat (JSON encoded twice?); {expected}\n"
    )
    err = _trim_error(tmp_path, capsys, json.dumps({**BODY, "messages": json.dumps(BODY["messages"])}))
    assert f'chat.json: "messages" is a string, not a list; {expected}' in err
    assert main(["trim", "no-such-chat.json", "--max-tokens", "2000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("contextwarden: no-such-chat.json: no such file (") and "- for stdin" in err


def test_previous_that_is_not_a_decision_is_named(tmp_path, capsys):
    """It said `unknown decision format None` (or `not a TrimDecision: list`), naming nothing."""
    for name, text in (("prices.json", '{"models": {}}'), ("list.json", "[1, 2]"), ("text.json", "hello")):
        path = tmp_path / name
        path.write_text(text)
        err = _trim_error(tmp_path, capsys, None, "--previous", str(path))
        assert err.startswith(
            f"contextwarden: --previous {path}: not a decision written by `contextwarden trim --json`"
        )
        assert err.count("\n") == 1


def test_previous_of_a_trim_that_cut_nothing_is_no_decision(tmp_path, capsys):
    """`trim --json` of a chat that fit has `"decision": null`: the next turn has nothing to reuse."""
    assert main(["trim", str(EXAMPLE), "--max-tokens", "100000", "--json"]) == 0
    path = tmp_path / "turn1.json"
    path.write_text(capsys.readouterr().out)
    assert json.loads(path.read_text())["decision"] is None
    assert main(["trim", str(EXAMPLE), "--max-tokens", "1200", "--previous", str(path)]) == 0


def test_a_binary_file_is_named(tmp_path, capsys):
    """A decoding error said `'utf-8' codec can't decode byte 0x89 in position 0`, naming no file."""
    image = tmp_path / "photo.png"
    image.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    assert main(["trim", str(image), "--max-tokens", "2000"]) == 2
    assert capsys.readouterr().err.startswith(f"contextwarden: {image}: not UTF-8 text (byte 0x89 at offset 0)")
    err = _trim_error(tmp_path, capsys, None, "--previous", str(image))
    assert err.startswith(f"contextwarden: --previous {image}: not UTF-8 text (byte 0x89 at offset 0)")


def test_usage_refuses_since_after_until(capsys):
    """`--since` after `--until` read no day and said nothing of it; refused before Redis is dialled."""
    code = main(["usage", "--redis-url", "redis://never-dialled:1/0", "--since", "2026-12-05", "--until", "2026-12-01"])
    assert code == 2
    assert capsys.readouterr().err == (
        "contextwarden usage: --since 2026-12-05 is after --until 2026-12-01: no day is in between\n"
    )


def test_usage_until_help_says_what_it_does(capsys):
    """`--until` said "(default: today)" but without it no upper bound is applied: every day kept
    is read (a worker whose clock runs ahead writes days after the reader's today; the tests'
    own records are on far-future days). The help now says so."""
    with pytest.raises(SystemExit):
        main(["usage", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "last UTC day to include, YYYY-MM-DD (default: all kept)" in help_text
    assert "default: today" not in help_text


def test_json_nested_too_deeply_is_named_not_a_traceback(tmp_path, capsys):
    """`[[[...]]]` 100,000 deep raised RecursionError out of json: a traceback and status 1."""
    deep = "[" * 100_000 + "]" * 100_000
    err = _trim_error(tmp_path, capsys, deep)
    assert err == f"contextwarden: {tmp_path / 'chat.json'}: JSON nested too deeply to read (no chat nests so deep)\n"
    err = _trim_error(tmp_path, capsys, None, "--previous", str(tmp_path / "chat.json"))
    assert err.startswith(f"contextwarden: --previous {tmp_path / 'chat.json'}: not a decision")
    assert err.count("\n") == 1


def test_a_chat_over_the_size_limit_is_refused_before_it_is_read(tmp_path, capsys):
    """The whole file was read and decoded before its size was checked: 9 MB of bytes that are
    not UTF-8 said `not UTF-8 text`, and a file of gigabytes was read into memory first."""
    big = tmp_path / "big.json"
    big.write_bytes(b"\xff" * 9_000_001)
    assert main(["trim", str(big), "--max-tokens", "2000"]) == 2
    assert capsys.readouterr().err.startswith(f"contextwarden: {big}: 9.0 MB, over the --max-input-mb limit of 8 MB")


def test_a_directory_is_named_as_one(tmp_path, capsys):
    """It said `[Errno 21] Is a directory: '...'`, naming no option."""
    assert main(["trim", str(tmp_path), "--max-tokens", "2000"]) == 2
    assert capsys.readouterr().err == f"contextwarden: {tmp_path}: a directory, not a file\n"
    err = _trim_error(tmp_path, capsys, None, "--previous", str(tmp_path))
    assert err == f"contextwarden: --previous {tmp_path}: a directory, not a file\n"


def test_stdin_that_is_not_utf8_is_named_as_a_file_is(monkeypatch, capsys):
    """Read through a text stream that escapes bad bytes (a POSIX locale's), stdin's 0xff said
    `not JSON (line 1, column 1: Expecting value)`; it is read as bytes, as a file is."""
    import io

    for data, said in ((b"\xff[", "not UTF-8 text (byte 0xff at offset 0)"), (b"x" * 2_000_001, "over the")):
        stream = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="surrogateescape")
        monkeypatch.setattr(sys, "stdin", stream)
        assert main(["trim", "-", "--max-tokens", "2000", "--max-input-mb", "2"]) == 2
        assert capsys.readouterr().err.startswith(f"contextwarden: stdin: {said}")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(json.dumps(BODY).encode())))
    assert main(["trim", "-", "--max-tokens", "2000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["messages"] == BODY["messages"]


def test_a_chat_saved_with_a_byte_order_mark_is_read(tmp_path, capsys):
    """Notepad and PowerShell's UTF-8 start with EF BB BF: it said `not JSON (line 1, column 1:
    Unexpected UTF-8 BOM (decode using utf-8-sig))`."""
    path = tmp_path / "notepad.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(BODY).encode())
    assert main(["trim", str(path), "--max-tokens", "2000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["messages"] == BODY["messages"]


def test_text_that_cannot_be_printed_as_it_is_is_printed_safely(tmp_path, capsys):
    """A lone surrogate (`\\ud800`, valid JSON) stopped `trim` half-way through its output with
    `'utf-8' codec can't encode character`, and --json wrote half a document; a terminal escape
    in a chat from elsewhere reached the terminal."""
    chat = [{"role": "user\x1b[31m", "content": "\x1b[2J\ud800 hi"}]
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(chat))
    assert main(["trim", str(path), "--max-tokens", "2000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["messages"] == chat
    for extra in ([], ["--explain"]):
        assert main(["trim", str(path), "--max-tokens", "2000", *extra]) == 0
        out = capsys.readouterr().out
        out.encode("utf-8")
        assert "\x1b" not in out and "user\ufffd[31m" in out
        assert extra or "\ufffd[2J\ufffd hi" in out


def test_one_message_is_said_in_the_singular(tmp_path, capsys):
    """`1 → 1 messages · 8 → 8 tokens`, under the table and the explanation alike."""
    path = tmp_path / "chat.json"
    path.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    for extra in ([], ["--explain"]):
        assert main(["trim", str(path), "--max-tokens", "2000", *extra]) == 0
        assert "\n1 → 1 message · " in capsys.readouterr().out
    assert main(["trim", str(EXAMPLE), "--max-tokens", "1200"]) == 0
    assert "\n22 → 6 messages · " in capsys.readouterr().out


def test_an_empty_chat_is_refused(tmp_path, capsys):
    """`[]` printed an empty table and `0 → 0 messages · 3 → 3 tokens` with status 0."""
    for text in ("[]", '{"model": "gpt-4o", "messages": []}'):
        err = _trim_error(tmp_path, capsys, text)
        assert err.startswith(f"contextwarden: {tmp_path / 'chat.json'}: no messages, nothing to trim; expected")
        assert err.count("\n") == 1


@pytest.mark.parametrize("size", ["-1", "nan", "inf", "lots"])
def test_a_size_limit_that_is_no_size_is_refused(size, capsys):
    """`--max-input-mb -1` refused every chat as `0.0 MB, over the --max-input-mb limit of -1 MB`;
    `nan` lifted the limit without a word."""
    with pytest.raises(SystemExit) as exited:
        main(["trim", str(EXAMPLE), "--max-tokens", "2000", "--max-input-mb", size])
    assert exited.value.code == 2
    assert f"argument --max-input-mb: not a size in MB: '{size}'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "value"), [("--low-watermark", "0"), ("--low-watermark", "nan"), ("--growth-turns", "-1")]
)
def test_trim_names_the_selection_option_that_is_wrong(option, value, tmp_path, capsys):
    """They said the library's names: `low_watermark must be in (0, 1], got 0.0`."""
    err = _trim_error(tmp_path, capsys, None, option, value)
    assert err.startswith(f"contextwarden: {option} must be ") and err.count("\n") == 1
