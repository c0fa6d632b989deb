"""The price book: bundled, file and OpenRouter-payload prices (Decimal USD per token), and
resolution of the model ids Open WebUI sees (aliases, connection prefixes, :variants,
dated snapshots, dots vs dashes) to one priced id, or to None with the reason. Pure: no I/O
but reading a file on request; the network edge is live_prices.py."""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
import stat
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from types import MappingProxyType

from ..caches import GLOB_MEMO_SIZE, lru_hit, register
from ..errors import ConfigError, PricingError
from .price_data import BUNDLED_PRICES, BUNDLED_PRICES_DATE

__all__ = [
    "MAX_DECIMAL_CHARS",
    "MAX_PRICE_USD_PER_TOKEN",
    "MAX_PRICE_FILE_BYTES",
    "read_decimal",
    "FREE_PRICE",
    "PriceTier",
    "ModelPrice",
    "PriceBook",
    "Resolution",
    "resolve_model",
    "parse_aliases",
    "parse_model_globs",
    "unreadable_entries",
]

_PRICE_ZERO = Decimal(0)
# Bounds on what a price or cost may be, checked before any Decimal is built: longer number text
# (or an exponent of more than 3 digits) is not a price, and converting it could take seconds.
MAX_DECIMAL_CHARS = 64
MAX_PRICE_USD_PER_TOKEN = Decimal(1)  # the dearest real price is ~0.0006; above this = unknown
MAX_PRICE_FILE_BYTES = 8 * 1024 * 1024  # the bundled pricing.json is ~0.2 MiB
_DECIMAL_TEXT = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]{1,3})?")
# OpenRouter pricing key -> ModelPrice field. Missing means 0 in the 2026 API (zero keys are
# left out), except the 1-hour cache write, which is simply "not listed" (None), and prompt and
# completion: every model lists them (free ones as "0"), so an entry without them (an empty or
# renamed `pricing`) is unknown, never $0.
_OPENROUTER_PRICE_KEYS = (
    ("prompt", "prompt"),
    ("completion", "completion"),
    ("input_cache_read", "cache_read"),
    ("input_cache_write", "cache_write"),
    ("input_cache_write_1h", "cache_write_1h"),
)
_OPENROUTER_REQUIRED = ("prompt", "completion")
_PRICE_TIER_FIELDS = ("prompt", "completion", "cache_read", "cache_write", "cache_write_1h")
_MODEL_DATE_SUFFIX = re.compile(r"-(?:\d{4}-\d{2}-\d{2}|\d{8})$")


@dataclass(frozen=True, slots=True)
class PriceTier:
    """Per-token prices that apply from `min_prompt_tokens` prompt tokens up (0 = base)."""

    min_prompt_tokens: int
    prompt: Decimal | None
    completion: Decimal | None
    cache_read: Decimal | None
    cache_write: Decimal | None
    cache_write_1h: Decimal | None = None


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """USD per token for one model. None = unknown (never billed as 0); Decimal(0) = free.

    `cache_write_1h` None means not listed (writes are billed at `cache_write`);
    `internal_reasoning` None means reasoning tokens are billed as completion tokens.
    `tiers` are complete price sets for large prompts, ascending by `min_prompt_tokens`.
    """

    prompt: Decimal | None
    completion: Decimal | None
    cache_read: Decimal | None = _PRICE_ZERO
    cache_write: Decimal | None = _PRICE_ZERO
    cache_write_1h: Decimal | None = None
    internal_reasoning: Decimal | None = None
    context_length: int | None = None
    canonical_slug: str | None = None
    tiers: tuple[PriceTier, ...] = ()
    varies_by_time: bool = False

    def rates_for(self, prompt_tokens: int | None) -> PriceTier:
        """The price set for a prompt of this size: the highest tier reached, else the base.

        Args:
            prompt_tokens: the whole prompt (cached tokens included); None = base prices.

        Example: a 250,000-token prompt to google/gemini-2.5-pro gets the 200,000+ tier.
        """
        chosen = PriceTier(0, self.prompt, self.completion, self.cache_read, self.cache_write, self.cache_write_1h)
        for tier in self.tiers:
            if prompt_tokens is not None and prompt_tokens >= tier.min_prompt_tokens:
                chosen = tier
        return chosen


FREE_PRICE = ModelPrice(prompt=_PRICE_ZERO, completion=_PRICE_ZERO)


def read_decimal(raw: object, *, ceiling: Decimal) -> Decimal | None:
    """A finite Decimal from 0 to `ceiling` (a number, or plain ASCII decimal text), else None.

    Bounded before converting: text over MAX_DECIMAL_CHARS, exponents of more than 3 digits,
    non-ASCII digits and ints of more than 64 bits are refused unread, so no input can make a
    huge number (forged `"1e999000"` would take ~30 s to turn into an int later on).

    Example:
        >>> read_decimal("0.0105", ceiling=Decimal(1000)), read_decimal("1e999000", ceiling=Decimal(1000))
        (Decimal('0.0105'), None)
    """
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        value = Decimal(raw) if raw.bit_length() <= 64 else None
    elif isinstance(raw, float):
        value = Decimal(repr(raw)) if math.isfinite(raw) else None
    elif isinstance(raw, Decimal):
        value = raw
    elif isinstance(raw, str) and len(raw) <= MAX_DECIMAL_CHARS and _DECIMAL_TEXT.fullmatch(raw.strip()):
        value = Decimal(raw.strip())
    else:
        value = None
    if value is None or not value.is_finite() or value < 0 or value > ceiling:
        return None
    return value


def _price_decimal(raw: object) -> Decimal | None:
    """A per-token price (see `read_decimal`), else None (unknown)."""
    return read_decimal(raw, ceiling=MAX_PRICE_USD_PER_TOKEN)


def _price_timestamp(raw: object) -> float | None:
    """A finite, non-negative Unix time from JSON, else None (1e400 or a 4,000-digit int too)."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        return None
    try:
        value = float(raw)
    except OverflowError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


def _read_price_file(path: str | Path) -> str:
    """The text of a price file, checked before it is opened (see `PriceBook.from_file`)."""
    limit = f"larger than {MAX_PRICE_FILE_BYTES // (1024 * 1024)} MiB"
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise PricingError("price file is not a regular file")
        if info.st_size > MAX_PRICE_FILE_BYTES:
            raise PricingError(f"price file is {limit}")
        # O_NONBLOCK: should it be swapped for a FIFO after the check, opening still returns.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise PricingError("price file is not a regular file")
            data = handle.read(MAX_PRICE_FILE_BYTES + 1)
    except OSError as exc:
        raise PricingError(f"cannot read price file ({exc.strerror or type(exc).__name__})") from exc
    if len(data) > MAX_PRICE_FILE_BYTES:
        raise PricingError(f"price file is {limit}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PricingError(f"price file is not UTF-8 text (bad byte at {exc.start})") from exc


def _price_document(text: str | bytes, source: str) -> dict:
    """pricing.json text parsed: an object whose `models` is an object.

    Raises:
        PricingError: not JSON, or no `models` object.
    """
    try:
        document = json.loads(text)
    except RecursionError as exc:
        raise PricingError(f"{source}: JSON nested too deeply") from exc
    except ValueError as exc:
        raise PricingError(f"{source}: not valid JSON ({exc})") from exc
    if not isinstance(document, dict) or not isinstance(document.get("models"), dict):
        raise PricingError(f"{source}: expected an object with a 'models' object")
    return document


def unreadable_entries(models: Mapping) -> str | None:
    """`N of M entries unreadable (entry k: why)` for a price file's `models` (the first entry
    that cannot be read as written, by position: never its model id or values), or None.

    An entry that is not an object is left out; a price missing or unreadable is unknown (the
    live or bundled price stands in where the model id is also there, see `PriceBook.layered`).
    `null` is an unknown price on purpose, not a problem.

    Example:
        >>> unreadable_entries({"a/b": {"prompt": "0.000001", "completion": 1e-6}, "c/d": 5}).split(";")[0]
        '1 of 2 entries unreadable (entry 2: not an object)'
    """
    if not models:
        return "no entries in its 'models' object"
    problems = [(number, why) for number, record in enumerate(models.values(), 1) if (why := _record_problem(record))]
    if not problems:
        return None
    number, why = problems[0]
    return (
        f"{len(problems)} of {len(models)} entries unreadable (entry {number}: {why}); "
        "entries that are not objects are left out, unreadable prices are unknown"
    )


def _record_problem(record: object) -> str | None:
    """Why one price-file entry cannot be read as written, or None (see `unreadable_entries`)."""
    if not isinstance(record, Mapping):
        return "not an object"
    for name in _OPENROUTER_REQUIRED:
        if name not in record:
            return f"no {name} price"
    for name in (*_PRICE_TIER_FIELDS, "internal_reasoning"):
        if (why := _price_problem(name, record.get(name))) is not None:
            return why
    tiers = record.get("tiers")
    if tiers is not None and not isinstance(tiers, list):
        return "tiers is not a list"
    for number, tier in enumerate(tiers or (), 1):
        if not isinstance(tier, Mapping) or _price_positive_int(tier.get("min_prompt_tokens")) is None:
            return f"tier {number} is not an object with a min_prompt_tokens above 0"
        for name in _PRICE_TIER_FIELDS:
            if (why := _price_problem(name, tier.get(name))) is not None:
                return f"tier {number}: {why}"
    return None


def _price_problem(name: str, raw: object) -> str | None:
    """Why a price field is not a price (never its value), or None; `null` is unknown on purpose."""
    if raw is None or _price_decimal(raw) is not None:
        return None
    if read_decimal(raw, ceiling=Decimal(10**12)) is not None:
        return f"{name} is over $1 a token (prices are USD per token: $2.50 per million is 0.0000025)"
    return f"{name} is not a price (a number or number text, USD per token, 0 or more)"


def _price_text(value: Decimal | None) -> str | None:
    """Decimal -> plain string for JSON (no exponent), None stays None."""
    return None if value is None else format(value, "f")


def _price_positive_int(raw: object) -> int | None:
    """An int > 0 (not a bool), else None."""
    if isinstance(raw, int) and not isinstance(raw, bool) and raw > 0:
        return raw
    return None


def _model_from_openrouter(entry: Mapping) -> ModelPrice | None:
    """One `/api/v1/models` entry (2025 or 2026 shape) -> ModelPrice, None if unusable."""
    pricing = entry.get("pricing")
    if not isinstance(pricing, Mapping):
        return None
    fields: dict = {}
    for key, name in _OPENROUTER_PRICE_KEYS:
        if key in pricing:
            fields[name] = _price_decimal(pricing[key])
        else:
            fields[name] = None if name == "cache_write_1h" or key in _OPENROUTER_REQUIRED else _PRICE_ZERO
    reasoning = _price_decimal(pricing.get("internal_reasoning"))
    if reasoning is not None and (reasoning == 0 or reasoning == fields["completion"]):
        reasoning = None
    tiers: list[PriceTier] = []
    varies_by_time = False
    overrides = pricing.get("overrides")
    for override in overrides if isinstance(overrides, list) else ():
        if not isinstance(override, Mapping):
            continue
        if "utc_start" in override or "utc_end" in override:
            varies_by_time = True
            continue
        threshold = _price_positive_int(override.get("min_prompt_tokens"))
        if threshold is not None:
            tier_fields = {
                name: _price_decimal(override[key]) if key in override else fields[name]
                for key, name in _OPENROUTER_PRICE_KEYS
            }
            tiers.append(PriceTier(threshold, **tier_fields))
    slug = entry.get("canonical_slug")
    return ModelPrice(
        internal_reasoning=reasoning,
        context_length=_price_positive_int(entry.get("context_length")),
        canonical_slug=slug if isinstance(slug, str) and slug else None,
        tiers=tuple(sorted(tiers, key=lambda tier: tier.min_prompt_tokens)),
        varies_by_time=varies_by_time,
        **fields,
    )


def openrouter_unlisted(payload: object) -> tuple[int, int]:
    """(entries whose `pricing` lacks prompt or completion, entries): priced as unknown, worth
    a warning, since a renamed key in the API would otherwise go unnoticed."""
    entries = payload.get("data") if isinstance(payload, dict) else None
    entries = [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []
    missing = sum(
        1
        for e in entries
        if isinstance(e.get("pricing"), Mapping) and any(key not in e["pricing"] for key in _OPENROUTER_REQUIRED)
    )
    return missing, len(entries)


def _model_from_record(record: Mapping) -> ModelPrice:
    """One pricing.json record -> ModelPrice. Missing or malformed prices are unknown;
    fields a tier leaves out are inherited from the base."""
    base = {name: _price_decimal(record.get(name)) for name in _PRICE_TIER_FIELDS}
    reasoning = _price_decimal(record.get("internal_reasoning"))
    tiers = []
    raw_tiers = record.get("tiers")
    for raw in raw_tiers if isinstance(raw_tiers, list) else ():
        if not isinstance(raw, Mapping):
            continue
        threshold = _price_positive_int(raw.get("min_prompt_tokens"))
        if threshold is not None:
            tier_fields = {
                name: _price_decimal(raw[name]) if name in raw else base[name] for name in _PRICE_TIER_FIELDS
            }
            tiers.append(PriceTier(threshold, **tier_fields))
    slug = record.get("canonical_slug")
    return ModelPrice(
        internal_reasoning=reasoning if reasoning else None,
        context_length=_price_positive_int(record.get("context_length")),
        canonical_slug=slug if isinstance(slug, str) and slug else None,
        tiers=tuple(sorted(tiers, key=lambda tier: tier.min_prompt_tokens)),
        varies_by_time=record.get("varies_by_time") is True,
        **base,
    )


def _model_to_record(price: ModelPrice) -> dict:
    """ModelPrice -> pricing.json record (the inverse of `_model_from_record`)."""
    record: dict = {name: _price_text(getattr(price, name)) for name in _PRICE_TIER_FIELDS}
    record["internal_reasoning"] = _price_text(price.internal_reasoning)
    record["context_length"] = price.context_length
    record["canonical_slug"] = price.canonical_slug
    record["varies_by_time"] = price.varies_by_time
    record["tiers"] = [
        {
            "min_prompt_tokens": tier.min_prompt_tokens,
            **{name: _price_text(getattr(tier, name)) for name in _PRICE_TIER_FIELDS},
        }
        for tier in price.tiers
    ]
    return record


def _model_bare_id(model_id: str) -> str:
    """The part after the provider namespace: 'openai/gpt-4.1' -> 'gpt-4.1'."""
    return model_id.partition("/")[2] or model_id


def _model_dashed_id(model_id: str) -> str:
    """Dots as dashes, for 'claude-sonnet-4.5' == 'claude-sonnet-4-5'."""
    return model_id.replace(".", "-")


def _price_index_add(index: dict[str, set[str]], key: str | None, model_id: str) -> None:
    """Add model_id under key (lowercased) in a many-valued index."""
    if key:
        index.setdefault(key.lower(), set()).add(model_id)


@dataclass(frozen=True, slots=True)
class PriceBook:
    """Model id -> ModelPrice, with where the prices came from and lookup indexes."""

    prices: Mapping[str, ModelPrice]
    source: str
    source_date: str | None = None
    fetched_at: float | None = None
    _lower: Mapping[str, str] = field(init=False, repr=False, compare=False)
    _by_key: Mapping[str, Mapping[str, frozenset[str]]] = field(init=False, repr=False, compare=False)
    _providers: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Freeze the table and build the indexes the resolution steps use."""
        object.__setattr__(self, "prices", MappingProxyType(dict(self.prices)))
        indexes: dict[str, dict[str, set[str]]] = {"canonical_slug": {}, "bare": {}, "dashed": {}}
        for model_id, price in self.prices.items():
            if ":" in model_id:
                continue  # variants (:free, :batch, ...) are only ever matched exactly
            _price_index_add(indexes["canonical_slug"], price.canonical_slug, model_id)
            for name in filter(None, (model_id, price.canonical_slug)):
                bare = _model_bare_id(name)
                _price_index_add(indexes["bare"], bare, model_id)
                _price_index_add(indexes["dashed"], _model_dashed_id(name), model_id)
                _price_index_add(indexes["dashed"], _model_dashed_id(bare), model_id)
        object.__setattr__(self, "_lower", {k.lower(): k for k in self.prices})
        object.__setattr__(
            self,
            "_by_key",
            {step: {key: frozenset(ids) for key, ids in index.items()} for step, index in indexes.items()},
        )
        providers = {k.lstrip("~").partition("/")[0].lower() for k in self.prices if "/" in k}
        object.__setattr__(self, "_providers", frozenset(providers))

    @classmethod
    def from_bundled(cls) -> PriceBook:
        """The table generated into price_data.py (no file or network needed)."""
        prices = {}
        for model_id, row in BUNDLED_PRICES.items():
            slug, length, prompt, completion, read, write, write_1h, reasoning, timed, tiers = row
            prices[model_id] = ModelPrice(
                prompt=_price_decimal(prompt),
                completion=_price_decimal(completion),
                cache_read=_price_decimal(read),
                cache_write=_price_decimal(write),
                cache_write_1h=_price_decimal(write_1h),
                internal_reasoning=_price_decimal(reasoning),
                context_length=length,
                canonical_slug=slug or model_id,
                varies_by_time=timed,
                tiers=tuple(PriceTier(t[0], *(_price_decimal(v) for v in t[1:])) for t in tiers),
            )
        return cls(prices, source="bundled", source_date=BUNDLED_PRICES_DATE)

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "pricing.json") -> PriceBook:
        """Parse pricing.json text (our own format, see build/make_pricing.py).

        Raises:
            PricingError: not JSON, or no `models` object.
        """
        return cls._from_document(_price_document(text, source), source)

    @classmethod
    def _from_document(cls, document: dict, source: str) -> PriceBook:
        """The book of a parsed pricing.json (see `_price_document`)."""
        models = document["models"]
        prices = {str(k): _model_from_record(v) for k, v in models.items() if isinstance(v, Mapping)}
        day = document.get("source_date")
        return cls(
            prices,
            source=source,
            source_date=day[:32] if isinstance(day, str) else None,
            fetched_at=_price_timestamp(document.get("fetched_at")),
        )

    @classmethod
    def from_file(cls, path: str | Path, *, source: str | None = None) -> PriceBook:
        """Load an admin's (or the repository's) pricing.json. Blocking: call it off the loop.

        Only a regular file of at most MAX_PRICE_FILE_BYTES is opened (a FIFO or a device
        would block or never end), and it must be UTF-8 JSON.

        Raises:
            PricingError: unreadable, not a regular file, too large, or bad content.
        """
        return cls.from_file_checked(path, source=source)[0]

    @classmethod
    def from_file_checked(cls, path: str | Path, *, source: str | None = None) -> tuple[PriceBook, str | None]:
        """`from_file`, and what in it could not be read as written (`unreadable_entries`), or
        None: an admin's typo would otherwise price a model as unknown, or not at all, unseen.

        Raises:
            PricingError: as `from_file`.
        """
        name = source or str(path)
        document = _price_document(_read_price_file(path), name)
        return cls._from_document(document, name), unreadable_entries(document["models"])

    @classmethod
    def from_openrouter(
        cls,
        payload: object,
        *,
        source: str = "openrouter",
        fetched_at: float | None = None,
        source_date: str | None = None,
    ) -> PriceBook:
        """Read a `GET /api/v1/models` payload, 2025 shape (every key) or 2026 (zeros omitted).

        Raises:
            PricingError: no `data` list, or not one usable model in it.
        """
        entries = payload.get("data") if isinstance(payload, dict) else None
        if not isinstance(entries, list):
            raise PricingError(f"{source}: expected an object with a 'data' list")
        prices = {}
        for entry in entries:
            model_id = entry.get("id") if isinstance(entry, dict) else None
            if not isinstance(model_id, str) or not model_id:
                continue
            price = _model_from_openrouter(entry)
            if price is not None:
                prices[model_id] = price
        if not prices:
            raise PricingError(f"{source}: no usable model in {len(entries)} entries")
        return cls(prices, source=source, source_date=source_date, fetched_at=fetched_at)

    def to_json(self) -> str:
        """Serialize in pricing.json form (sorted keys), e.g. to share through Redis."""
        document = {
            "format": 1,
            "models": {k: _model_to_record(v) for k, v in self.prices.items()},
            "source": self.source,
            "source_date": self.source_date,
        }
        if self.fetched_at is not None:
            document["fetched_at"] = self.fetched_at
        return json.dumps(document, sort_keys=True, separators=(",", ":"))

    def layered(self, top: PriceBook) -> PriceBook:
        """A book where `top`'s models replace or add to these (admin file > live > bundled); an
        entry whose prompt or completion price `top` could not read (malformed, "-1") does not
        hide one here that has both: a bad feed must not make a model unpriced (and its replies
        free of dollar limits)."""
        prices = dict(self.prices)
        for model, price in top.prices.items():
            below = prices.get(model)
            if below is None or _fully_priced(price) or not _fully_priced(below):
                prices[model] = price
        return PriceBook(
            prices,
            source=f"{top.source}+{self.source}",
            source_date=top.source_date or self.source_date,
            fetched_at=top.fetched_at or self.fetched_at,
        )

    def find(self, model_id: str) -> str | None:
        """The id as stored, matched case-insensitively, or None."""
        return self._lower.get(model_id.lower())

    def matches(self, step: str, key: str) -> frozenset[str]:
        """Variant-less ids whose `step` key ('canonical_slug', 'bare', 'dashed') equals key."""
        return self._by_key[step].get(key.lower(), frozenset())

    def has_provider(self, namespace: str) -> bool:
        """True when some id starts with `namespace/` (e.g. 'anthropic')."""
        return namespace.lower() in self._providers


def _fully_priced(price: ModelPrice) -> bool:
    """Both the prompt and the completion price are known."""
    return price.prompt is not None and price.completion is not None


@dataclass(frozen=True, slots=True)
class Resolution:
    """Outcome of resolve_model: the priced id and step that matched, or None and why.

    `step` is one of alias, free, exact, variant, canonical_slug, bare, date_suffix,
    dots_dashes; `prefix` is the connection prefix that was removed, if any; `price` is
    what to bill with. For `free` the model_id is the requested id and price FREE_PRICE.
    """

    requested: str
    model_id: str | None
    step: str | None
    reason: str | None = None
    prefix: str | None = None
    price: ModelPrice | None = None


def _strip_connection_prefix(model_id: str, book: PriceBook, prefixes: Sequence[str]) -> tuple[str, str | None]:
    """Remove an Open WebUI connection prefix (`prefix_id.model`), returning (id, prefix).

    Configured prefixes are removed when the id starts with `prefix.`. Without configuration
    only the unambiguous pattern `conn.provider/model` is recognised: the namespace before
    the first '/' contains a dot and ends in a provider the book knows (catalogue namespaces
    never contain dots). Ids without '/' are never split, so 'gpt-4.1' stays 'gpt-4.1'.
    """
    for prefix in sorted((p for p in prefixes if p), key=len, reverse=True):
        if model_id.startswith(prefix + ".") and len(model_id) > len(prefix) + 1:
            return model_id[len(prefix) + 1 :], prefix
    namespace, slash, rest = model_id.partition("/")
    if slash and "." in namespace and not book.has_provider(namespace):
        prefix, _dot, provider = namespace.rpartition(".")
        if prefix and book.has_provider(provider):
            return f"{provider}/{rest}", prefix
    return model_id, None


def _model_glob_match(model_id: str, patterns: Iterable[str]) -> str | None:
    """The first pattern (exact text or fnmatch glob) matching model_id, else None. The
    patterns are compiled once per value of the valve (fnmatch's own cache holds 32,768)."""
    key = tuple(patterns)
    match = lru_hit(_glob_matchers, key)
    if match is None:
        match = _glob_matcher(key)
        if len(_glob_matchers) >= GLOB_MEMO_SIZE:
            _glob_matchers.popitem(last=False)
        _glob_matchers[key] = match
    return match(model_id)


_glob_matchers: OrderedDict[tuple[str, ...], Callable[[str], str | None]] = OrderedDict()
register("pricing._glob_matchers", _glob_matchers.clear)


def _glob_matcher(patterns: tuple[str, ...]) -> Callable[[str], str | None]:
    """`_model_glob_match` for these patterns: a set for the exact ones, compiled regexes for the globs."""
    exact = frozenset(patterns)
    globs = [(p, re.compile(fnmatch.translate(p)).match) for p in patterns if any(c in p for c in "*?[")]

    def first(model_id: str) -> str | None:
        if model_id in exact:
            return model_id
        return next((p for p, match in globs if match(model_id)), None)

    return first


# OpenRouter's `:variant` suffixes (priced as their model when not listed apart). Any other tag of
# an id without a provider (`deepseek-r1:7b`, `qwen3-coder:30b`, `llama3.1:latest`) is Ollama's:
# a local model, never the API model of the same name (`_local_tag`).
OPENROUTER_VARIANTS = frozenset({"free", "nitro", "beta", "extended", "thinking", "online", "floor", "exacto"})


def _local_tag(query: str) -> bool:
    """An Ollama-style id: `name:tag` without a provider, the tag no OpenRouter variant.

    Example:
        >>> _local_tag("deepseek-r1:7b"), _local_tag("deepseek/deepseek-r1:free"), _local_tag("gpt-4o:nitro")
        (True, False, False)
    """
    name, colon, tag = query.partition(":")
    return bool(colon) and "/" not in name and tag.lower() not in OPENROUTER_VARIANTS


def _resolve_chain(query: str, book: PriceBook) -> tuple[str | None, str | None, str | None]:
    """exact -> without :variant -> canonical_slug -> bare -> date suffix -> dots/dashes.

    Returns (model_id, step, reason). A step is accepted only when it finds exactly one
    model; when it finds several, resolution stops there as ambiguous.
    """
    found = book.find(query)
    if found:
        return found, "exact", None
    if _local_tag(query):
        return None, None, None
    base = query.partition(":")[0] if ":" in query else query
    if base != query and book.find(base):
        return book.find(base), "variant", None
    undated = _MODEL_DATE_SUFFIX.sub("", base)
    attempts: list[tuple[str, str | None, str]] = [
        ("canonical_slug", "canonical_slug", base),
        ("bare", "bare", _model_bare_id(base)),
    ]
    if undated != base:
        attempts += [("date_suffix", None, undated), ("date_suffix", "bare", _model_bare_id(undated))]
    attempts.append(("dots_dashes", "dashed", _model_dashed_id(undated)))
    for step, index, key in attempts:
        if index is None:
            exact = book.find(key)
            hits = frozenset(() if exact is None else (exact,))
        else:
            hits = book.matches(index, key)
        if len(hits) == 1:
            return next(iter(hits)), step, None
        if len(hits) > 1:
            shown = ", ".join(sorted(hits)[:4])
            return None, None, f"ambiguous at step {step}: {len(hits)} models match ({shown})"
    return None, None, None


def _by_alias(
    requested: str, names: Sequence[str], prefix: str | None, book: PriceBook, aliases: Mapping[str, str]
) -> Resolution | None:
    """The resolution an admin alias gives the first of `names` it matches (None: no alias matches)."""
    for name in names:
        pattern = _model_glob_match(name, aliases)
        if pattern is None:
            continue
        target = aliases[pattern]
        resolved, _step, reason = _resolve_chain(target, book)
        if resolved is None:
            return Resolution(
                requested,
                None,
                None,
                prefix=prefix,
                reason=(
                    f"model_aliases maps {pattern!r} to {target!r}, which is not in the price "
                    f"book ({book.source})" + (f"; {reason}" if reason else "")
                ),
            )
        return Resolution(requested, resolved, "alias", prefix=prefix, price=book.prices[resolved])
    return None


def resolve_model(
    model_id: str,
    book: PriceBook,
    *,
    aliases: Mapping[str, str] | None = None,
    prefixes: Sequence[str] = (),
    free_models: Sequence[str] = (),
) -> Resolution:
    """Find the price-book model an Open WebUI model id stands for, never by substring.

    Order: admin aliases (exact ids, then `*` globs in the order given; the target goes
    through the chain below) -> `free_models` globs (billed at 0) -> exact -> without
    `:variant` -> canonical_slug -> part after '/' -> without a date suffix -> dots vs
    dashes. Connection prefixes are removed first (see `_strip_connection_prefix`).

    Args:
        model_id: the id from the request body (for workspace models pass the base model id).
        book: prices to resolve against.
        aliases: admin map of id or glob -> price-book id (see `parse_aliases`).
        prefixes: Open WebUI connection prefix ids, e.g. ("openrouter",).
        free_models: globs of models that cost nothing (local Ollama models, say).

    Example:
        >>> resolve_model("gpt-4.1", PriceBook.from_bundled()).model_id
        'openai/gpt-4.1'
    """
    requested = model_id.strip() if isinstance(model_id, str) else ""
    if not requested:
        return Resolution(str(model_id), None, None, reason="empty model id")
    query, prefix = _strip_connection_prefix(requested, book, prefixes)
    names = (requested, query) if query != requested else (requested,)
    if aliases:
        aliased = _by_alias(requested, names, prefix, book, aliases)
        if aliased is not None:
            return aliased
    for name in names:
        if _model_glob_match(name, free_models) is not None:
            return Resolution(requested, requested, "free", prefix=prefix, price=FREE_PRICE)
    resolved, step, reason = _resolve_chain(query, book)
    if resolved is not None:
        return Resolution(requested, resolved, step, prefix=prefix, price=book.prices[resolved])
    if reason is None:
        reason = f"no model in the price book ({book.source}) matches {requested!r}"
        if ":" in requested and "/" not in requested:
            reason += (
                "; it looks like a local (Ollama) model: list it in free_models if it "
                "costs nothing, or map it in model_aliases"
            )
    return Resolution(requested, None, None, reason=reason, prefix=prefix)


def parse_aliases(text: str) -> dict[str, str]:
    """Parse the `model_aliases` valve: a JSON object of model id or glob -> priced id.

    Args:
        text: e.g. '{"my-gpt": "openai/gpt-4o", "claude-*": "anthropic/claude-sonnet-4.5"}';
            empty text means no aliases.

    Raises:
        ConfigError: (valve="model_aliases") invalid JSON, not an object, or a value that is
            not a non-empty string.

    Example:
        >>> parse_aliases('{"my-gpt": "openai/gpt-4o"}')
        {'my-gpt': 'openai/gpt-4o'}
    """
    if not text or not text.strip():
        return {}
    example = 'expected a JSON object such as {"my-gpt": "openai/gpt-4o"}'
    try:
        parsed = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"model_aliases is not valid JSON ({exc}); {example}", valve="model_aliases") from exc
    if not isinstance(parsed, dict):
        raise ConfigError(f"model_aliases is a JSON {type(parsed).__name__}; {example}", valve="model_aliases")
    aliases: dict[str, str] = {}
    for number, (key, value) in enumerate(parsed.items(), 1):
        if not key.strip():
            raise ConfigError("model_aliases has an empty model id as a key", valve="model_aliases")
        if not isinstance(value, str) or not value.strip():  # named by position: a value is never shown
            raise ConfigError(
                f"model_aliases: entry {number} must be a model id string, not {type(value).__name__}",
                valve="model_aliases",
            )
        aliases[key.strip()] = value.strip()
    return aliases


def parse_model_globs(text: str) -> tuple[str, ...]:
    """Split a valve like `free_models` ("llama*, ollama.*" or one per line) into globs.

    Args:
        text: comma- or newline-separated ids or fnmatch globs; blanks are ignored.

    Example:
        >>> parse_model_globs("llama*, qwen3:*\\n")
        ('llama*', 'qwen3:*')
    """
    return tuple(part.strip() for part in re.split(r"[,\n]", text or "") if part.strip())
