"""`explain_trim` and `contextwarden trim --explain` (table and JSON) on a crafted chat where
every reason shows up: system, current turn, pinned, recent, tool pair, orphan, score, reused
from the previous decision, shortened and summarized."""

from __future__ import annotations

import json
import re

from contextwarden.core.trim import trim_messages
from contextwarden.tools.cli import main
from contextwarden.tools.explain import explain_trim

MODEL = "gpt-4o"


def crafted() -> list[dict]:
    filler = "weather rain clouds wind " * 40
    return [
        {"role": "system", "content": "You are helpful."},  # 0 system
        {"role": "user", "content": "Remember: my cat is called Miso."},  # 1 pinned
        {"role": "assistant", "content": "Noted, Miso the cat."},  # 2
        {"role": "user", "content": "Tell me about the weather. " + filler},  # 3 low score
        {"role": "assistant", "content": "It rains. " + filler},  # 4 low score
        {"role": "tool", "tool_call_id": "ghost", "content": "orphan result"},  # 5 orphan
        {"role": "user", "content": "Look up cat food brands for Miso."},  # 6
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "search", "arguments": "{}"}}],
        },  # 7 tool pair
        {"role": "tool", "tool_call_id": "t1", "content": "cat food brands for cats: Miso likes fish"},  # 8 tool pair
        {"role": "assistant", "content": "Cats like Miso enjoy fish-based cat food."},  # 9
        {"role": "user", "content": "Some small talk " + "about nothing much " * 30},  # 10 recent (keep 2)
        {"role": "assistant", "content": "Sure, " + "nothing much " * 30},  # 11 recent
        {"role": "user", "content": "What is my cat called, and what food does the cat like?"},  # 12 current
    ]


def reasons_of(explanation) -> dict[int, str]:
    return {row.index: " | ".join(row.reasons) for row in explanation.messages}


def test_every_reason_on_the_crafted_chat(counter):
    chat = crafted()
    options = dict(
        keep_last_turns=2, pinned=[1], growth_turns=0
    )  # room for 0.8 of 420 tokens (the growth rule: test_trim)
    result = trim_messages(chat, max_tokens=420, model=MODEL, token_counter=counter, **options)
    assert 3 in result.dropped and 5 in result.dropped and {0, 1, 7, 8, 10, 12} <= set(result.kept)
    explanation = explain_trim(chat, result, model=MODEL, token_counter=counter, summarized=[3, 4], **options)
    why = reasons_of(explanation)
    actions = {row.index: row.action for row in explanation.messages}
    assert why[0] == "mandatory: system prompt" and why[12] == "mandatory: current turn (latest question)"
    assert why[1].startswith("pinned") and "recent (keep_last_turns=2)" in why[10]
    assert why[5] == "orphan tool message: its call is not in the chat, never sent" and actions[5] == "dropped"
    assert "tool pair: messages 7–8 are kept or dropped together" in why[7] and "tool pair" in why[8]
    assert "score: its turn's value" in why[6] and "worth its tokens" in why[6] and "whole turn" in why[6]
    assert (
        actions[3] == actions[4] == "summarized"
        and "below what was kept" in why[3]
        and "a summary note stands for it" in why[3]
    )
    scores = {row.index: row.score for row in explanation.messages}
    assert scores[0] is None and scores[12] is None and scores[6] > scores[3]  # about the cat vs about the weather
    parts = explanation.budget
    costs = [counter.count_message(m, MODEL) for m in chat]
    assert (parts.budget, parts.system_tokens, parts.current_turn_tokens) == (420, costs[0], costs[12])
    assert (
        parts.history_available == 420 - 3 - costs[0] - costs[12]
        and parts.history_target == int(420 * 0.8) - 3 - costs[0] - costs[12]
    )
    assert parts.history_sent == result.tokens_after - 3 - costs[0] - costs[12]

    # Next turn with the decision: the kept prefix is reused, the new messages are "new".
    grown = chat + [{"role": "assistant", "content": "Miso; fish."}, {"role": "user", "content": "Thanks!"}]
    again = trim_messages(
        grown, max_tokens=420, model=MODEL, token_counter=counter, previous=result.decision, **options
    )
    assert again.reused
    explained = explain_trim(grown, again, model=MODEL, token_counter=counter, previous=result.decision, **options)
    why = reasons_of(explained)
    assert "reused from the previous decision" in why[6] and "new since the previous decision" in why[13]
    # ... and its recall block is a part of the budget: the parts add up to what was sent.
    parts = explained.budget
    assert again.added and parts.recall_sent == sum(counter.count_each([again.messages[k] for k in again.added], MODEL))
    spent = parts.system_tokens + parts.current_turn_tokens + parts.reply_priming_tokens
    assert spent + parts.history_sent + parts.recall_sent == again.tokens_after

    # A system prompt bigger than the budget is shortened.
    huge = [{"role": "system", "content": "rules " * 2_000}, {"role": "user", "content": "Hi?"}]
    cut = trim_messages(huge, max_tokens=300, model=MODEL, token_counter=counter)
    rows = explain_trim(huge, cut, model=MODEL, token_counter=counter).messages
    assert rows[0].action == "shortened" and rows[0].reasons[0] == "mandatory content over budget: cut middle-out"


def test_a_chat_that_fits_says_so(counter):
    chat = crafted()[:3] + [{"role": "user", "content": "Hi"}]
    result = trim_messages(chat, max_tokens=5_000, model=MODEL, token_counter=counter)
    rows = explain_trim(chat, result, model=MODEL, token_counter=counter).messages
    assert [r.action for r in rows] == ["kept"] * 4 and rows[1].reasons == ("everything fits the budget",)


def test_cli_explain_table_and_json(tmp_path, capsys):
    path = tmp_path / "chat.json"
    path.write_text(json.dumps({"model": MODEL, "messages": crafted()}))
    args = [
        "trim",
        str(path),
        "--max-tokens",
        "1444",
        "--reserve",
        "1024",
        "--keep-last-turns",
        "2",
        "--pin",
        "1",
        "--explain",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["#", "role", "tokens", "action", "score", "why"]
    assert any(
        line.split()[:4] == ["5", "tool", line.split()[2], "dropped"] and "orphan" in line for line in lines[1:14]
    )
    assert "budget 420 = window 1,444 − reserve 1,024" in out and "left for history" in out and "system prompt" in out
    assert main(args + ["--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    explained = document["explain"]
    assert (
        explained["budget"]["reserve"] == 1024
        and explained["budget"]["window"] == 1444
        and explained["budget"]["budget"] == 420
    )
    rows = {r["index"]: r for r in explained["messages"]}
    assert rows[0]["reasons"] == ["mandatory: system prompt"] and rows[5]["action"] == "dropped"
    assert [r["action"] for r in explained["messages"]] == [
        "kept" if i in document["kept"] else "shortened" if i in document["shortened"] else "dropped" for i in range(13)
    ]
    # --previous takes this output: the next turn reuses its prefix.
    previous = tmp_path / "turn1.json"
    previous.write_text(json.dumps(document))
    grown = crafted() + [{"role": "assistant", "content": "Miso; fish."}, {"role": "user", "content": "Thanks!"}]
    path.write_text(json.dumps({"model": MODEL, "messages": grown}))
    assert main(args + ["--previous", str(previous)]) == 0
    out = capsys.readouterr().out
    assert "reused from the previous decision" in out and "(the previous decision, reused)" in out
    assert re.search(r"\n  recall blocks +\d+ \(older messages quoted for this question\)\n", out)
    assert main(args + ["--previous", str(previous), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recalled"]  # what the block quotes


def test_the_explained_turn_value_is_the_one_the_selection_weighs(counter):
    from contextwarden.core.chatview import ChatView
    from contextwarden.core.relevance import score_messages
    from contextwarden.core.selection import DEFAULT_COST_EXPONENT, turn_values

    chat = crafted()
    result = trim_messages(chat, max_tokens=420, model=MODEL, token_counter=counter, pinned=[1], growth_turns=0)
    why = reasons_of(explain_trim(chat, result, model=MODEL, token_counter=counter, pinned=[1], growth_turns=0))
    costs = counter.count_each(chat, MODEL)
    scores = score_messages(chat, question=12, exclude=[0, 5])
    conversation = ChatView(chat)
    turn = next(t for t, turn in enumerate(conversation.turns) if 3 in turn.indices)
    worth = turn_values(conversation, costs, scores)[turn]
    assert worth > scores[3] + scores[4]  # it shares in the turn next to it
    expected = worth / (costs[3] + costs[4]) ** DEFAULT_COST_EXPONENT
    assert f"its turn's value {expected:.3f} per token" in why[3]


def test_explain_takes_every_option_trim_messages_takes(counter):
    """The options given to `trim_messages` are given to `explain_trim` as they are (one dict),
    and an unknown one is refused as `trim_messages` refuses it."""
    chat = crafted()
    options = dict(strategy="recent", keep_last_turns=2, growth_turns=0, recall_share=0.0, shorten=False, embed=None)
    result = trim_messages(chat, max_tokens=420, model=MODEL, token_counter=counter, **options)
    why = reasons_of(explain_trim(chat, result, model=MODEL, token_counter=counter, **options))
    assert "recent (keep_last_turns=2)" in why[10]
    try:
        explain_trim(chat, result, model=MODEL, token_counter=counter, keep_last_turn=2)
    except TypeError as exc:
        assert "keep_last_turn" in str(exc)
    else:
        raise AssertionError("an unknown option was accepted")


def test_a_question_cut_by_passages_says_how_many_went(counter):
    """A document pasted with its question, alone over the budget, is cut by passages: explained
    as excerpted, with its passages sent of those it has (the status line's count). A question
    too short for three passages is cut middle-out and says so (it read "by passages")."""
    ask = "Which lamp did the keeper relight?"
    report = "\n\n".join(f"Section {k}. The harbour committee met on day {k}. " * 6 for k in range(30))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{report}\n\n{ask}"}]
    result = trim_messages(chat, max_tokens=800, model=MODEL, token_counter=counter)
    [(at, sent, total)] = result.shortened_passages
    row = explain_trim(chat, result, model=MODEL, token_counter=counter).messages[at]
    assert at == 1 and row.action == "excerpted"
    assert row.reasons[0] == f"mandatory content over budget: cut by passages, {sent} of {total} sent"

    short = [{"role": "user", "content": "word " * 110}]
    cut = trim_messages(short, max_tokens=60, model=MODEL, token_counter=counter)
    row = explain_trim(short, cut, model=MODEL, token_counter=counter).messages[0]
    assert row.action == "shortened" and row.reasons[0] == "mandatory content over budget: cut middle-out"
