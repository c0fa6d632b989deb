"""The bookkeeping path: a turn's money around its reply, apart from the Open WebUI face.

Before the reply: `!usage` answered, a user over a limit refused (`before_turn`), the turn
started in this worker and its estimate charged (`start_turn`). While it streams: what the
reply carries counted, each provider call's usage settled (`stream_event`). After it
(`reply`): the usage billed (the backend's, estimated where it said nothing; for a turn started
here never below what the worker saw of it, `_at_least_seen`), priced, logged as one
`usage {json}` line, added to the ledger and the spend totals (the turn's charge settled), and
what it teaches learned (calibration, cache stats); `reply_line` is the turn's one status line.
A summary call the trim made is a cost of the turn's user too (`summary_call`, bound to the
settings by `billing_summaries`): billed, priced, logged and added the same way, under the
summary model. The filter passes the counter, the store, the clock, the settings and the price
resolution in; a test can drive it without Open WebUI.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from ..core.tokens import TokenCounter
from ..errors import AnsweredInChat, TurnRefused
from ..money.accounting import billed_usage, learn_caching, learn_calibration, reply_savings_of, usage_record
from ..money.ledger import record_reply
from ..money.limits import STORE_DOWN_TEXT, Limits, Spend, Verdict, check_limits, limits_for, refusal_text, spend_parts
from ..money.openturns import (
    MAX_OPEN_TURNS,
    MAX_USER_OPEN_TURNS,
    OpenTurn,
    OpenTurns,
    read_chunk,
    reply_allowance,
    rough_tokens,
)
from ..money.pricing import Resolution
from ..money.records import SUMMARY_CALL, TurnNote, UsageRecord
from ..money.savings import Savings
from ..money.spendbook import Charge, SpendBook
from ..money.usage import Cost, Estimated, Usage, compute_cost, read_usage
from ..state.store import RedisStore, Store
from .adminview import USAGE_WRITTEN, is_usage_command, usage_answer
from .hookargs import METADATA_KEY, Emitter, base_model_id, chat_ids, is_chat_body, is_direct, runs_as_chat_task
from .offloop import compute, heavy
from .settings import MODES, Settings
from .status import pending_detail, pending_line, turn_line, usage_status
from .summarize import SummaryCall
from .usergroups import GroupReader

__all__ = ["Bookkeeping", "BookedReply", "FLOORED_NOTE"]

books_log = logging.getLogger("contextwarden")

MAX_RETIRED_STORES = 8  # stores `redis_url` changes left behind, kept until their turns are settled
FLOORED_NOTE = "usage below what this worker saw of the turn; booked as it saw it"  # the usage line's cost_note


@dataclass(frozen=True, slots=True)
class BookedReply:
    """A reply as the bookkeeping billed it: what the turn's status line reads."""

    model_id: str
    note: TurnNote  # what the turn's passes noted
    mode: str  # the mode the turn ran in
    billed: Usage
    estimated: Estimated  # which of its counts contextwarden counted itself
    cost: Cost
    savings: Savings | None
    off: bool  # the chat is big enough that work on it goes off the event loop


async def _store_failed(exc: Exception, settings: Settings) -> None:
    """The spend could not be read: fail-closed refuses the turn (`TurnRefused`), fail-open logs it."""
    if settings.limit_store_failure == "fail-closed":
        books_log.warning("contextwarden: limits not checked (%s); turn refused (fail-closed)", type(exc).__name__)
        raise TurnRefused(STORE_DOWN_TEXT) from None
    books_log.warning("contextwarden: limits not checked (%s); turn allowed (fail-open)", type(exc).__name__)


def _at_least_seen(started: OpenTurn, billed: Usage, estimated: Estimated, cost: Cost) -> tuple[Usage, Estimated, Cost]:
    """A started turn's reply as its outlet billed it, or as this worker saw it (`OpenTurn.sight`)
    when the outlet's charge is below that in dollars or tokens (Open WebUI reads the outlet's
    usage from the saved chat, which the user writes): usage line, ledger row, status line and
    spend then agree. Estimated where the worker counted it; the usage line's cost note says so."""
    seen = started.sight()
    charge = Charge.of(billed, cost.cost_usd)
    if charge.at_least(seen.charge) == charge:
        return billed, estimated, cost
    floor, cost_usd = compute_cost(seen.usage, started.price), seen.charge.cost_usd
    if floor.cost_usd != cost_usd:  # a tool loop's calls, each priced at its own prompt's tier
        floor = replace(floor, cost_usd=cost_usd, cost_source=None if cost_usd is None else "price_table")
    return seen.usage, Estimated(seen.counted, seen.counted), replace(floor, notes=(*floor.notes, FLOORED_NOTE))


class Bookkeeping:
    """The bookkeeping path of one filter: limits, the turns it started, usage, spend, the ledger."""

    def __init__(
        self,
        *,
        counter: TokenCounter,
        store: Callable[[], Store],
        now: Callable[[], datetime],
        settings: Callable[[dict | None], Awaitable[Settings]],
        resolve: Callable[[Settings, str, Emitter | None], Awaitable[Resolution]],
        warn_once: Callable[[str], None],
    ) -> None:
        """`store` returns the filter's current store (it follows the `redis_url` valve), `now`
        the time (days and months of limits and the ledger follow it), `settings` a user's
        settings (valve problems told as the filter tells them), `resolve` the price book's model
        for an id, `warn_once` logs a warning once a process."""
        self._counter = counter
        self._store_of = store
        self._now = now
        self._settings = settings
        self._resolve = resolve
        self._warn_once = warn_once
        self._open = OpenTurns()
        self._retired: list[Store] = []  # oldest first
        self._spendbook = SpendBook()
        self._groups = GroupReader()

    @property
    def _store(self) -> Store:
        return self._store_of()

    async def retire(self, store: Store) -> None:
        """The filter left `store` for another (`redis_url` changed). Turns charged in it are
        still settled there, so it is kept until none is left and what it holds back for its
        server was sent, then closed. At most MAX_RETIRED_STORES are kept: past that the oldest
        is closed as it is (a turn settled in it later opens a connection again)."""
        self._retired.append(store)
        while len(self._retired) > MAX_RETIRED_STORES:
            await self._close(self._retired.pop(0))

    async def _close_retired(self) -> None:
        """Close each store left behind that no turn kept here is charged in and that holds
        nothing back (`Store.flush`: sent now if its server answers, else tried again later)."""
        for store in list(self._retired):
            try:
                if self._open.holds(store) or not await store.flush():
                    continue
            except Exception as exc:  # never costs the turn that starts
                books_log.debug("contextwarden: old store not flushed (%s)", type(exc).__name__)
                continue
            self._retired.remove(store)
            await self._close(store)

    @staticmethod
    async def _close(store: Store) -> None:
        """Close a store left behind; what it could not send to its server is lost (logged)."""
        try:
            if not await store.flush():
                books_log.warning("contextwarden: a store redis_url no longer names closed with usage not sent")
            await store.aclose()
        except Exception as exc:
            books_log.debug("contextwarden: old store not closed (%s)", type(exc).__name__)

    async def stream_event(self, metadata: dict | None, event: Any) -> None:
        """One streamed chunk: counted, and its usage settled, when its turn started here."""
        note = metadata.get(METADATA_KEY) if isinstance(metadata, dict) else None
        turn = self._open.find(note.get("turn") if isinstance(note, dict) else None)
        if turn is not None:
            await self._watch(turn, event)

    async def reply(
        self,
        body: dict,
        user: dict | None,
        metadata: dict | None,
        model: dict | None,
        settings: Settings,
        emit: Emitter | None,
    ) -> BookedReply:
        """After a reply: bill its usage, log one `usage {json}` line, add it to the ledger and the
        spend totals (its turn's charge settled), and learn from it (`emit`: price problems)."""
        metadata = metadata if isinstance(metadata, dict) else {}
        note = TurnNote.from_dict(metadata.get(METADATA_KEY))
        started = self._open.finish(note.turn_id)  # None: a bare outlet (another worker's, or forged)
        try:
            return await self._reply(body, user, metadata, model, settings, emit, note, started)
        finally:
            if started is not None:
                self._open.unhold(started.store)  # it may be closed now, if `redis_url` left it

    async def _reply(
        self,
        body: dict,
        user: dict | None,
        metadata: dict,
        model: dict | None,
        settings: Settings,
        emit: Emitter | None,
        note: TurnNote,
        started: OpenTurn | None,
    ) -> BookedReply:
        """`reply` for the turn its outlet finished (`started`, None for a bare outlet)."""
        model_id = base_model_id(body, model)
        resolution = await self._resolve(settings, model_id, emit)
        usage = self._reply_usage(body["messages"][-1])
        off = heavy(body["messages"])
        billed, estimated = await compute(
            off, billed_usage, self._counter, usage, note.estimated_prompt_tokens, body["messages"], model_id
        )
        cost = compute_cost(billed, resolution.price)
        if started is not None:  # the outlet's usage is the client's: never booked below what was seen
            billed, estimated, cost = _at_least_seen(started, billed, estimated, cost)
        mode = note.mode if note.mode in MODES else settings.mode
        tokens_saved = note.tokens_saved if mode != "off" else None
        savings = await reply_savings_of(self._store, billed, note, str(mode), tokens_saved, resolution, model_id)
        record = usage_record(
            model_id=model_id,
            resolution=resolution,
            user_id=(user or {}).get("id"),
            chat_id=body.get("chat_id") or metadata.get("chat_id") or None,
            billed=billed,
            estimated=estimated.any,
            estimated_prompt=note.estimated_prompt_tokens,
            cost=cost,
            mode=str(mode),
            tokens_saved=tokens_saved,
            savings=savings,
        )
        books_log.info("usage %s", record.to_json())
        await self._book(
            settings,
            (user or {}).get("id"),
            resolution.model_id or model_id,
            billed,
            estimated.any,
            cost,
            record,
            started,
        )
        if started is not None:  # only a turn this worker started teaches (a bare outlet may be forged)
            await self._learn(settings, started, note, resolution.model_id or model_id)
        return BookedReply(model_id, note, str(mode), billed, estimated, cost, savings, off)

    def billing_summaries(self, settings: Settings, body: dict, user: dict | None, metadata: object) -> Settings:
        """`settings` whose summary calls this turn makes are counted as the turn's user's
        (`summary_call`); as they are without summaries."""
        if settings.summary is None:
            return settings
        chat_id = chat_ids(body, None, metadata if isinstance(metadata, dict) else None)[1] or None
        spent = functools.partial(self.summary_call, settings, user, chat_id)
        return replace(settings, summary=replace(settings.summary, spent=spent))

    async def summary_call(self, settings: Settings, user: dict | None, chat_id: str | None, call: SummaryCall) -> None:
        """A summary call the provider may bill, as a cost of the turn's user: its usage (estimated
        from what was sent and received when it reported none; one that failed after it was sent,
        from what was sent and the `max_tokens` asked for, the most it can cost), priced for the
        summary model, logged (`usage {json}`, `call: summary`), added to the ledger under that
        model and to the user's spend for the day (what limits read), each whether or not the
        other was. Raises on anything else: its caller (`summarize._count_call`) warns once and
        keeps the summary."""
        user_id = (user or {}).get("id")
        resolution = await self._resolve(settings, call.model, None)
        usage = self._reply_usage({"usage": call.usage}, "summary")
        messages = [*call.sent, {"role": "assistant", "content": call.reply or ""}]
        at_most = call.max_tokens if call.reply is None else None  # no summary came back: the most it can be
        billed, estimated = await compute(
            heavy(messages), billed_usage, self._counter, usage, None, messages, call.model, at_most
        )
        cost = compute_cost(billed, resolution.price)
        record = usage_record(
            model_id=call.model,
            resolution=resolution,
            user_id=user_id,
            chat_id=chat_id,
            billed=billed,
            estimated=estimated.any,
            estimated_prompt=None,
            cost=cost,
            mode=settings.mode,
            tokens_saved=None,
            savings=None,
        )
        books_log.info("usage %s", replace(record, call=SUMMARY_CALL).to_json())
        model_key = resolution.model_id or call.model
        await self._book(settings, user_id, model_key, billed, estimated.any, cost, record, None, "summary call")

    async def reply_line(self, settings: Settings, user: dict | None, booked: BookedReply, shown: bool) -> str | None:
        """The turn's one status line after its reply: what the model saw (the passes' words), what
        the reply used and cost, the user's spend (`shown`: there is a chat to show it in); None
        when status lines are off. The passes' detail goes to the log."""
        noted = booked.note.to_dict()
        if (detail := pending_detail(noted)) is not None:
            books_log.info("contextwarden: %s", detail)
        spent, warning = await self._spend_status(settings, user, shown=shown)
        if not settings.show_status:
            return None
        shadow = booked.mode == "shadow"  # what a trim saves is the admin's (log, report), but shadow's point
        savings = booked.savings if shadow else None
        used = usage_status(booked.billed, booked.estimated, booked.cost, settings.show_cost, savings, shadow)
        return turn_line(pending_line(noted), used, spent, warning)

    async def before_turn(
        self, body: Any, user: dict | None, metadata: dict | None, emit: Emitter | None, request: Any = None
    ) -> None:
        """Answer `!usage` (raises `AnsweredInChat` once it is written into a browser chat's
        reply, else `TurnRefused` with it), or refuse a turn over the user's limits (raises
        `TurnRefused`); a turn let through while the user is near a limit is held until its outlet."""
        if not is_chat_body(body) or not isinstance(user, dict):
            return
        metadata = metadata if isinstance(metadata, dict) else body.get("metadata")
        if isinstance(metadata, dict) and metadata.get("task"):
            return
        settings = await self._settings(user)  # problems are shown once, by the trim
        user_id, role = str(user.get("id") or ""), str(user.get("role") or "")
        if is_usage_command(body["messages"]):
            limits = await self._user_limits(settings, user_id, role)
            text, written = await usage_answer(
                self._store,
                now=self._now(),
                admin=role == "admin",
                limits=limits,
                rules=settings.limits,
                emit=emit,
                chat=runs_as_chat_task(metadata, request),
                spend=functools.partial(self._spendbook.spend, self._store, user_id or "-", self._now().date()),
            )
            if written:  # the page shows it: end the turn with no error under it
                raise AnsweredInChat(USAGE_WRITTEN)
            raise TurnRefused(text)
        limits = await self._user_limits(settings, user_id, role)
        if not limits.any:
            return
        spend = await self._spend_or_none(user_id, settings)
        if spend is None:
            return
        self._refuse_over(check_limits(limits, *spend))

    def _refuse_over(self, verdict: Verdict) -> Verdict:
        """Raise `TurnRefused` (the limit, the spend, the reset) when the verdict is a refusal."""
        if not verdict.allowed:
            books_log.info("contextwarden: turn refused (%s limit reached)", verdict.kind)
            raise TurnRefused(refusal_text(verdict, self._now()))
        return verdict

    async def start_turn(self, body: Any, user: dict | None, metadata: dict | None, model: dict | None) -> None:
        """Start the turn in this worker (`OpenTurns`, its id in the note) and, for a user with a
        limit, charge its estimate: the prompt as counted plus the reply's allowance, at the
        model's price. Refuses it (`TurnRefused`) when a turn that started meanwhile took the
        rest of the limit."""
        if not is_chat_body(body):
            return
        metadata = metadata if isinstance(metadata, dict) else body.get("metadata")
        if not isinstance(metadata, dict):
            metadata = {}  # no note can reach an outlet: the turn is still charged (an outlet adds it whole)
        if metadata.get("task") or is_usage_command(body["messages"]):
            return
        await self._settle_ended()
        user = user if isinstance(user, dict) else {}
        settings = await self._settings(user)
        user_id, role = str(user.get("id") or ""), str(user.get("role") or "")
        limits = await self._user_limits(settings, user_id, role)
        if settings.mode == "off" and not limits.any:
            return  # off sends the body exactly as it came, its metadata included
        note = TurnNote.from_dict(metadata.get(METADATA_KEY))
        model_id = base_model_id(body, model)
        resolution = await self._resolve(settings, model_id, None)
        turn = OpenTurn(
            turn_id=uuid.uuid4().hex,
            user=user_id,
            day=self._now().date(),
            model=resolution.model_id or model_id,
            price=resolution.price,
            prompt_tokens=note.estimated_prompt_tokens or rough_tokens(body["messages"]),
            reply_tokens=reply_allowance(body, settings.reserve_output_tokens),
            charged=None,
            started=time.monotonic(),
            store=self._store,  # settled and booked there, even after `redis_url` changes
            relayed=is_direct(model),
        )
        if limits.any:
            self._open.hold(turn.store)  # not closed while the charge goes in, if `redis_url` leaves it
            try:
                if await self._reserve(turn, turn.estimate, limits, settings):
                    turn.charged = turn.estimate
            finally:
                self._open.unhold(turn.store)
        pushed = self._open.start(turn)
        metadata[METADATA_KEY] = replace(note, turn_id=turn.turn_id).to_dict()
        if pushed:
            self._warn_once(
                f"contextwarden: a user had {MAX_USER_OPEN_TURNS:,} turns open in this worker, or the worker "
                f"{MAX_OPEN_TURNS:,}; the oldest are settled as ended"
            )
        for old in pushed:
            await self._settle_as_ended(old)

    async def _reserve(self, turn: OpenTurn, estimate: Charge, limits: Limits, settings: Settings) -> bool:
        """Check and charge in one step (`SpendBook.reserve`). When the store failed, the reserve
        may still have been applied (Redis answered too late): the estimate is charged unchecked
        under the same name, so it counts once, and taken back when the valve refuses the turn
        (fail-closed). False when even that failed (the turn goes uncharged, added whole at its end)."""
        name = f"reserve:{turn.turn_id}"
        try:
            verdict = await self._spendbook.reserve(
                turn.store, user=turn.user, day=turn.day, charge=estimate, limits=limits, name=name
            )
            self._check_shared(turn.store)
        except Exception as exc:
            refused = settings.limit_store_failure == "fail-closed"
            charged = await self._charge_unanswered(turn, estimate, name, keep=not refused)
            await _store_failed(exc, settings)  # fail-closed: raises TurnRefused
            return charged
        self._refuse_over(verdict)
        return True

    async def _charge_unanswered(self, turn: OpenTurn, estimate: Charge, name: str, *, keep: bool) -> bool:
        """`SpendBook.charge` for a reserve whose answer was lost; False when that failed too."""
        try:
            await self._spendbook.charge(
                turn.store, user=turn.user, day=turn.day, charge=estimate, name=name, keep=keep
            )
        except Exception as exc:
            books_log.warning("contextwarden: turn not charged (%s)", type(exc).__name__)
            return False
        return True

    async def _watch(self, turn: OpenTurn, event: Any) -> None:
        """One streamed chunk of a started turn: its text counted, its usage settled. A turn swept
        as ended that streams again (a tool ran past STREAM_IDLE_SECONDS) is open again: its
        ledger entry taken back, the call it waited for charged, and swept again when it ends."""
        turn.last_seen = time.monotonic()  # before any wait: no sweep takes it for quiet meanwhile
        if turn.ended:
            turn.ended = False  # a sweep that has not reached it yet leaves it alone
            await self._settle_open(turn, reopened=True)
        chars, asks_for_tools = read_chunk(event)
        turn.streamed += chars
        turn.calling = turn.calling or asks_for_tools
        raw = event.get("usage") if isinstance(event, dict) else None
        usage = read_usage({"usage": raw}) if isinstance(raw, dict) else None
        if usage is not None and turn.report(usage, event):
            await self._settle_open(turn)

    async def _settle_open(self, turn: OpenTurn, *, reopened: bool = False) -> None:
        """Settle a turn still streaming at what it used so far, read under its lock (`reopened`:
        swept as ended, it streams again: its ledger entry is taken back first). Nothing once
        its outlet finished it: the outlet settles it at what it really cost."""
        async with turn.settling:
            if turn.finished:
                return
            if reopened:
                await self._ledger_ended(turn, taken_back=True)
            await self._settle_held(turn, turn.used(open_turn=True)[1])

    async def _settle_held(self, turn: OpenTurn, real: Charge) -> None:
        """Bring a turn's place in its user's spend totals to `real`: the difference from what it
        was charged, or `real` whole for a turn that took none (no limit at its start, or the
        store away then), so every reply that ends counts. The caller holds `turn.settling`:
        the sweep, its stream and a late outlet may overlap, and each reads what the one
        before it left."""
        charged = turn.charged
        if not turn.user or charged == real:
            return
        try:
            await self._spendbook.settle(turn.store, user=turn.user, day=turn.day, charged=charged, real=real)
        except Exception as exc:
            books_log.warning("contextwarden: turn not settled (%s)", type(exc).__name__)
            return
        turn.charged = real

    async def _settle_ended(self) -> None:
        """Turns that ended without an outlet (`OpenTurns.due`), each settled as ended; then the
        stores `redis_url` changes left behind that no turn needs any more are closed."""
        for turn in self._open.due(time.monotonic()):
            await self._settle_as_ended(turn)
        if self._retired:
            await self._close_retired()

    async def _settle_as_ended(self, turn: OpenTurn) -> None:
        """A turn that ended without an outlet: a stopped stream settled at its prompt estimate
        plus what it streamed, one that showed nothing kept at its estimate, and added to the
        ledger as an estimated reply. All under its lock, and only while it is still ended and
        unfinished: the sweep picked it earlier, and its stream or outlet may have come since."""
        async with turn.settling:
            if not turn.ended or turn.finished or turn.booked is not None:
                return  # open again, finished, or settled as ended by the sweep or a push-out
            used, charge = turn.used()
            await self._settle_held(turn, charge)
            books_log.info("contextwarden: a turn ended without an outlet; settled at what this worker saw")
            turn.booked = (used, charge.cost_usd)
            await self._ledger_ended(turn)

    async def _ledger_ended(self, turn: OpenTurn, *, taken_back: bool = False) -> None:
        """An ended turn's figures (`booked`) into the usage ledger as an estimated reply, or out
        of it again (`taken_back`: its outlet came late and adds the real reply)."""
        if turn.booked is None:
            return
        used, cost = turn.booked
        try:
            await record_reply(
                turn.store,
                user=turn.user,
                model=turn.model,
                prompt_tokens=used.prompt_tokens,
                completion_tokens=used.completion_tokens,
                cost_usd=cost,
                estimated=not turn.stream_usage,
                day=turn.day,
                taken_back=taken_back,
            )
        except Exception as exc:
            books_log.warning("contextwarden: ended turn not in the usage ledger (%s)", type(exc).__name__)
            turn.booked = None
        else:
            if taken_back:
                turn.booked = None

    async def _user_limits(self, settings: Settings, user_id: str, role: str) -> Limits:
        """The limits of one user (none without an id, or when no limit is set anywhere)."""
        rules = settings.limits
        if not user_id or not rules.active:
            return Limits()
        groups = await self._groups.groups(user_id) if rules.needs_groups else frozenset()
        return limits_for(rules, role=role, groups=groups, user_id=user_id)

    async def _spend(self, user_id: str) -> tuple[Spend, Spend]:
        """(today's, this month's) spend of a user, from the spend totals (`spendbook.py`).

        Raises:
            ConnectionError: the Redis store did not answer (its in-process fallback is no total).
        """
        store = self._store
        spend = await self._spendbook.spend(store, user_id, self._now().date())
        self._check_shared(store)
        return spend

    @staticmethod
    def _check_shared(store: Store) -> None:
        """ConnectionError when the Redis store answered from its in-process fallback: that is
        no user's total, so what limits read or charged there does not count.

        Raises:
            ConnectionError: the Redis store is away.
        """
        if isinstance(store, RedisStore) and not store.shared:
            raise ConnectionError("usage store unreachable")

    async def _spend_or_none(self, user_id: str, settings: Settings) -> tuple[Spend, Spend] | None:
        """The spend to check; None lets the turn go (fail-open); fail-closed refuses it."""
        try:
            return await self._spend(user_id)
        except Exception as exc:
            await _store_failed(exc, settings)
            return None

    async def _record_spend(self, user_id: object, charge: Charge, what: str = "reply") -> None:
        """Add a reply (or `what` else was paid for) to its user's spend totals (what limits
        read); never costs the reply."""
        if not isinstance(user_id, str) or not user_id:
            return
        try:
            await self._spendbook.record(
                self._store, user=user_id, day=self._now().date(), cost_usd=charge.cost_usd, tokens=charge.tokens
            )
        except Exception as exc:
            books_log.warning("contextwarden: %s not added to the spend totals (%s)", what, type(exc).__name__)

    async def _spend_status(self, settings: Settings, user: dict | None, shown: bool) -> tuple[str, str]:
        """After a reply: (`today $0.42 of $2.00`, the 80% warning), each "" when there is none."""
        user_id, role = str((user or {}).get("id") or ""), str((user or {}).get("role") or "")
        if not user_id or not settings.show_status or not shown:
            return "", ""
        limits = await self._user_limits(settings, user_id, role)
        if not settings.show_spend or not (limits.any or settings.spend_for_all):
            return "", ""
        try:
            day, month = await self._spend(user_id)
        except Exception as exc:
            books_log.debug("contextwarden: spend not read (%s)", type(exc).__name__)
            return "", ""
        return spend_parts(limits, day, check_limits(limits, day, month), settings.show_spend)

    def _reply_usage(self, reply: dict, what: str = "reply") -> Usage | None:
        """The usage the backend reported on the reply (or a summary call, `what`); what it said
        that cannot be true is warned about."""
        rejected: list[str] = []
        usage = read_usage(reply, rejected)
        if rejected:
            self._warn_once(f"contextwarden: {what} usage not believed ({', '.join(rejected[:6])}); estimated instead")
        return usage

    async def _book(
        self,
        settings: Settings,
        user_id: Any,  # the client's: record_reply and the spend totals check it
        model_key: str,
        billed: Usage,
        estimated: bool,
        cost: Cost,
        record: UsageRecord,
        started: OpenTurn | None,
        what: str = "reply",
    ) -> None:
        """The reply (or a summary call, `what`) into the usage ledger, then the spend totals (its
        turn's charge settled, or added whole), each whether or not the other could be written:
        after the log line, once (never retried, so never counted twice)."""
        recorded = False
        try:
            await record_reply(
                started.store if started is not None else self._store,  # where its turn was charged
                user=user_id,
                model=model_key,
                prompt_tokens=billed.prompt_tokens,
                completion_tokens=billed.completion_tokens,
                cached_tokens=billed.cached_tokens,
                reasoning_tokens=billed.reasoning_tokens,
                cost_usd=cost.cost_usd,
                estimated=estimated,
                retention_days=settings.ledger_retention_days,
                day=started.day if started is not None else self._now().date(),  # the day its spend is on
                tokens_saved=record.tokens_saved or 0,
                cost_saved_usd=record.cost_saved_usd,
                shadow=record.mode == "shadow",
            )
            recorded = True
        except Exception as exc:
            books_log.warning("contextwarden: %s not added to the usage ledger (%s)", what, type(exc).__name__)
        charge = Charge.of(billed, cost.cost_usd)
        if started is None:
            await self._record_spend(user_id, charge, what)
            return
        async with started.settling:  # after a sweep settling it now, so its ledger entry is taken back
            if recorded:
                await self._ledger_ended(started, taken_back=True)  # a late outlet: its estimate out
            await self._settle_held(started, charge.at_least(started.seen()))  # never below what it saw

    async def _learn(self, settings: Settings, started: OpenTurn, note: TurnNote, model_key: str) -> None:
        """What a reply teaches every user of its model, from what the backend reported in its
        turn's stream (the outlet's usage is the client's to write): the count calibration (a
        comparable, exactly counted prompt) and whether the model's cache serves anything."""
        real = started.reported_prompt()
        if (
            settings.calibrate_counts
            and real is not None
            and note.estimated_prompt_tokens is not None
            and note.count_mode == "exact"
            and note.comparable
        ):
            try:
                await self._learn_calibration(model_key, note.estimated_prompt_tokens, real)
            except Exception as exc:
                books_log.warning("contextwarden: calibration not updated (%s)", type(exc).__name__)
        reported = started.reported()
        if reported is not None:
            try:
                await learn_caching(self._store, model_key, reported)
            except Exception as exc:
                books_log.debug("contextwarden: cache stats not updated (%s)", type(exc).__name__)

    async def _learn_calibration(self, model_key: str, counted: int, real: int | None) -> None:
        await learn_calibration(self._store, model_key, counted, real)
