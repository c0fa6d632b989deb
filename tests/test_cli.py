"""The `contextwarden` command on the example chat."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from contextwarden.cli import main

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
    run = subprocess.run([sys.executable, "-m", "contextwarden.cli", "build", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "up to date" in run.stdout
