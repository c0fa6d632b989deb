"""The prompt budget, and what every request bills besides its messages.

Providers bill the tool definitions (`body["tools"]`; Open WebUI 0.12.4 sends 30 built-in ones
in a user's browser chat, 3,214 tokens, 3,923 in an admin's) and a response-format schema on every call, inside the
prompt. OpenAI renders them into the system message as TypeScript-like text; `render_tools` and
`render_response_format` write that text, counted with the model's encoding. Checked against
OpenAI's cookbook rule of thumb for function definitions (7 tokens a function, 3 a property, 12
at the end; within 4% on Open WebUI's 58 built-ins: 5,858 rendered, 6,048 by the rule) and the
serialized JSON (8,194 tokens, 1.4x: providers that bill the raw schema are caught by the
learned calibration, which sees these tokens in every prompt it compares). Pure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..core.tokens import TokenCounter
from ..money.calibration import Calibration, calibrated_budget
from .settings import MIN_BUDGET_TOKENS

__all__ = ["FixedCost", "PromptBudget", "fixed_cost", "prompt_budget", "render_tools", "render_response_format"]

TOOLS_OVERHEAD_TOKENS = 4  # the system message the definitions open when the chat has none
MAX_SCHEMA_DEPTH = 8  # deeper parameter schemas are written as their JSON (never less text)
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=str)


@dataclass(frozen=True, slots=True)
class FixedCost:
    """Tokens a request costs whatever messages it sends: tool definitions, response format,
    and the sources Open WebUI put before the question (as sent: `core.sources`)."""

    tools: int = 0
    response_format: int = 0
    sources: int = 0

    @property
    def tokens(self) -> int:
        return self.tools + self.response_format + self.sources

    @property
    def label(self) -> str:
        """What the fixed part is, for the status line."""
        parts = (
            ["tool definitions"] * bool(self.tools)
            + ["the response format"] * bool(self.response_format)
            + ["the sources"] * bool(self.sources)
        )
        return " and ".join(parts)


@dataclass(frozen=True, slots=True)
class PromptBudget:
    """The whole prompt's budget in our counts (`total`), its fixed part, and what is left for
    the messages (`messages`, never below MIN_BUDGET_TOKENS). `fixed_over`: the fixed part
    alone leaves less than MIN_BUDGET_TOKENS, so the mandatory messages go whole, and others only
    while all of them fit MIN_BUDGET_TOKENS. `own`:
    the user's own budget (`!budget=N`, their valve) set `total`, below the window's."""

    total: int
    fixed: FixedCost
    messages: int
    fixed_over: bool = False
    own: bool = False


def prompt_budget(
    window_budget: int,
    calibration: Calibration,
    fixed: FixedCost = FixedCost(),
    cap: int | None = None,
    *,
    ceiling: int | None = None,
) -> PromptBudget:
    """The one budget rule: the window less the reserve (`window_budget`), in our counts
    (calibrated, never above `ceiling`), lowered to a user's `!budget=N` (`cap`, the provider's
    tokens as the user's valve is: calibrated too; never below MIN_BUDGET_TOKENS), less the fixed
    part; the rest is for the messages. `window_budget` below `ceiling` was lowered by the
    user's valve: with a lower `cap`, the budget is the user's own (`own`).

    Example:
        >>> budget = prompt_budget(3_500, Calibration(), FixedCost(tools=900))
        >>> budget.total, budget.fixed.tokens, budget.messages, budget.fixed_over, budget.own
        (3500, 900, 2600, False, False)
        >>> over = prompt_budget(3_500, Calibration(), FixedCost(tools=6_435), cap=2_000)
        >>> over.total, over.fixed_over, over.own
        (2000, True, True)
    """
    window = calibrated_budget(window_budget, calibration, ceiling=ceiling)
    total = window
    if cap is not None:
        total = max(MIN_BUDGET_TOKENS, min(total, calibrated_budget(cap, calibration)))
    own = total < window or (ceiling is not None and window_budget < ceiling)
    left = total - fixed.tokens
    return PromptBudget(total, fixed, max(left, MIN_BUDGET_TOKENS), left < MIN_BUDGET_TOKENS, own)


def fixed_cost(body: dict[str, Any], counter: TokenCounter, model: str | None) -> FixedCost:
    """What `body`'s tool definitions and response format cost in its prompt (0 when absent)."""
    tools = body.get("tools")
    tool_tokens = 0
    if isinstance(tools, list) and tools:
        tool_tokens = TOOLS_OVERHEAD_TOKENS + counter.count_text(render_tools(tools), model)
    response_format = body.get("response_format")
    format_tokens = (
        counter.count_text(render_response_format(response_format), model) if isinstance(response_format, dict) else 0
    )
    return FixedCost(tool_tokens, format_tokens)


def render_tools(tools: list[Any]) -> str:
    """Tool definitions as OpenAI renders them into the prompt (anything unexpected as its JSON).

    Example:
        >>> print(render_tools([{"type": "function", "function": {"name": "now", "description": "The time.",
        ...     "parameters": {"type": "object", "properties": {"tz": {"type": "string", "description": "Zone"}}}}}]))
        # Tools
        <BLANKLINE>
        ## functions
        <BLANKLINE>
        namespace functions {
        <BLANKLINE>
        // The time.
        type now = (_: {
        // Zone
        tz?: string,
        }) => any;
        <BLANKLINE>
        } // namespace functions
    """
    lines = ["# Tools", "", "## functions", "", "namespace functions {", ""]
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            lines += [_JSON.encode(tool), ""]
            continue
        description = function.get("description")
        if isinstance(description, str) and description:
            lines.append(f"// {description}")
        parameters = function.get("parameters")
        if isinstance(parameters, dict) and isinstance(parameters.get("properties"), dict) and parameters["properties"]:
            lines.append(f"type {function['name']} = (_: {_type_of(parameters, 0)}) => any;")
        else:
            lines.append(f"type {function['name']} = () => any;")
        lines.append("")
    lines.append("} // namespace functions")
    return "\n".join(lines)


def _type_of(schema: Any, depth: int) -> str:
    """A JSON schema as a TypeScript type, the way OpenAI writes parameters."""
    if not isinstance(schema, dict) or depth >= MAX_SCHEMA_DEPTH:
        return _JSON.encode(schema)
    if isinstance(schema.get("enum"), list):
        return " | ".join(_JSON.encode(value) for value in schema["enum"]) or "any"
    kind = schema.get("type")
    if kind == "object" and isinstance(schema.get("properties"), dict):
        required = schema.get("required")
        if not isinstance(required, list):
            required = []
        lines = ["{"]
        for name, prop in schema["properties"].items():
            description = prop.get("description") if isinstance(prop, dict) else None
            if isinstance(description, str) and description:
                lines.append(f"// {description}")
            lines.append(f"{name}{'' if name in required else '?'}: {_type_of(prop, depth + 1)},")
        lines.append("}")
        return "\n".join(lines)
    if kind == "array":
        return f"{_type_of(schema.get('items', {}), depth + 1)}[]"
    for union in ("anyOf", "oneOf"):
        if isinstance(schema.get(union), list):
            return " | ".join(_type_of(option, depth + 1) for option in schema[union]) or "any"
    if isinstance(kind, list):
        return " | ".join(map(str, kind)) or "any"
    return {"integer": "number"}.get(kind, kind) if isinstance(kind, str) else "any"


def render_response_format(response_format: dict[str, Any]) -> str:
    """A `response_format` as the prompt carries it: a JSON schema's name and schema; a few
    tokens for `json_object`; nothing for plain text.

    Example:
        >>> render_response_format({"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}})
        '# Response Formats\\n\\n## r\\n\\n{"type":"object"}'
    """
    kind = response_format.get("type")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        spec = spec if isinstance(spec, dict) else {}
        name = spec.get("name") if isinstance(spec.get("name"), str) else "response"
        description = spec.get("description")
        head = f"# Response Formats\n\n## {name}\n\n" + (
            f"// {description}\n" if isinstance(description, str) and description else ""
        )
        return head + _JSON.encode(spec.get("schema", {}))
    if kind == "json_object":
        return "Respond in JSON."
    return "" if kind in (None, "text") else _JSON.encode(response_format)
