"""The in-memory caches in one inventory (`caches.py`): every process-wide cache registered there,
each bound defined there only, and `clear_all()` emptying them all without changing a trim."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path
from types import SimpleNamespace

import contextwarden
from contextwarden import caches
from contextwarden.core import conversation, decision, excerpt, flags, recall_index, relevance, tokens, trim
from contextwarden.core.semantic import VECTORS
from contextwarden.core.trim import trim_messages
from contextwarden.face import embedder

from embedders import chat_about_a_cat, topic_embed

SRC = Path(contextwarden.__file__).resolve().parent
MODEL = "gpt-4o"


def _is_cache_call(value: ast.expr | None) -> bool:
    if not isinstance(value, ast.Call):
        return False
    func = value.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    return name == "OrderedDict" or name.endswith("Cache")


def module_level_caches(root: Path = SRC) -> set[str]:
    """`module.name` of every module-level cache: a function memoised with `lru_cache`, or a
    module-level name that says it is a cache or memo, or holds an `OrderedDict`, a `...Cache` or a
    `TokenCounter` (its counts)."""
    found = set()
    for path in sorted(root.rglob("*.py")):
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.FunctionDef):
                decorators = [d.func if isinstance(d, ast.Call) else d for d in node.decorator_list]
                if any(ast.unparse(d).split(".")[-1] in ("lru_cache", "cache") for d in decorators):
                    found.add(f"{path.stem}.{node.name}")
                continue
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            for target in targets:
                if not isinstance(target, ast.Name):
                    continue
                named = not target.id.isupper() and ("cache" in target.id.lower() or "memo" in target.id.lower())
                counter = isinstance(node, ast.AnnAssign) and "TokenCounter" in ast.unparse(node.annotation)
                if named or counter or _is_cache_call(node.value):  # type: ignore[union-attr]
                    found.add(f"{path.stem}.{target.id}")
    return found


def test_every_process_wide_cache_is_registered():
    for module in pkgutil.walk_packages(contextwarden.__path__, "contextwarden."):
        importlib.import_module(module.name)
    found = module_level_caches()
    assert {"decision._fingerprint_cache", "relevance._term_cache", "excerpt._question_words"} <= found
    assert set(caches.registered()) == found


def test_each_bound_is_defined_in_caches_only():
    tree = ast.parse((SRC / "caches.py").read_text())
    bounds = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if t.id.isupper()}  # type: ignore[attr-defined]
    assert {"DEFAULT_TERM_CACHE_SIZE", "DEFAULT_COUNT_CACHE_SIZE", "QUESTION_MEMO_SIZE"} <= bounds
    elsewhere = {
        f"{path.stem}.{t.id}"
        for path in SRC.rglob("*.py")
        if path.stem != "caches"
        for n in ast.parse(path.read_text()).body
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Name) and t.id in bounds
    }
    assert elsewhere == set()
    unused = {b for b in bounds if not any(b in p.read_text() for p in SRC.rglob("*.py") if p.stem != "caches")}
    assert unused == set()


def _turns(chat: list[dict]) -> list[tuple]:
    """Two turns of one chat, the second reusing the first's decision with a recall block."""
    first = trim_messages(chat, max_tokens=300, model=MODEL, embed=topic_embed)
    grown = chat + [{"role": "assistant", "content": "Yes."}, {"role": "user", "content": "And my cat's name?"}]
    second = trim_messages(grown, max_tokens=300, model=MODEL, previous=first.decision, embed=topic_embed)
    return [(r.kept, r.dropped, r.shortened, r.recalled, r.messages) for r in (first, second)]


def cache_sizes() -> dict[str, int]:
    """What each process-wide cache holds (entries, and for those bounded by terms, terms too)."""
    return {
        "term stats": len(relevance._term_cache._entries) + relevance._term_cache._terms,
        "fingerprints": len(decision._fingerprint_cache),
        "vectors": len(VECTORS),
        "frequencies": len(relevance._frequency_cache._entries),
        "recall indexes": len(recall_index._indexes._entries) + recall_index._indexes._terms,
        "word memo": sum(len(m) + len(m.several) for m in relevance._word_memos.values()),
        "question words": excerpt._question_words.cache_info().currsize,
        "chunks": len(excerpt._cached_chunk_index),
        "encodings": tokens._encoding_for_model_id.cache_info().currsize,
        "units": conversation._unit.cache_info().currsize,
        "code spans": len(flags._outside_code_memo),
        "adapters": len(embedder._adapters),
        "default counter": len(trim.default_counter()._cache),
    }


def test_clear_all_empties_every_process_wide_cache_and_changes_no_trim():
    chat = chat_about_a_cat()
    before = _turns(chat)
    flags._flag_matches("see `!pin` and then !full")
    excerpt.pointed_words(["the aisle is 42", "thanks"], "Which aisle?")
    excerpt._chunked("A long message.\n\nIn two paragraphs.")
    embedder.embedder_of(SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(EMBEDDING_FUNCTION=print))))
    filled = cache_sizes()
    assert all(filled.values()), filled

    caches.clear_all()

    assert cache_sizes() == dict.fromkeys(filled, 0)
    assert _turns(chat) == before  # a cold process trims as a warm one did


def test_text_cache_is_bounded_by_texts_and_by_characters_and_never_stale():
    made: list[str] = []

    def index(text: str) -> tuple[str, int]:
        made.append(text)
        return (text.upper(), len(text))

    memo = caches.TextCache(index, max_texts=3, max_chars=10)
    assert [memo(t) for t in ("aa", "bb", "aa")] == [("AA", 2), ("BB", 2), ("AA", 2)]
    assert made == ["aa", "bb"]  # "aa" again from the cache
    memo("cc"), memo("dd")  # a fourth text: the least recently used ("bb") goes
    assert len(memo) == 3 and memo.chars == 6
    memo("bb")
    assert made[-1] == "bb"
    memo("x" * 9)  # over the characters: the oldest go until it fits
    assert memo.chars <= 10 and memo("x" * 9) == ("X" * 9, 9)
    # A text edited in place is another key: its value is made anew, never the old one's.
    assert memo("aa!") == ("AA!", 3)
    memo.cache_clear()
    assert len(memo) == 0 and memo.chars == 0
