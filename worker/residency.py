"""Where an adapter lives (GPU slot, engine CPU cache, disk, S3), observed, and how it moves.

The engine knows an adapter as ``alias@<digest prefix>`` with an integer id fixed for that
digest in this process, so two revisions never share a name or an id (vLLM keys its caches
by both).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import NamedTuple, TypeVar, cast

from vllm.lora.request import LoRARequest
from vllm.v1.engine.exceptions import EngineDeadError

from contracts.digests import short
from contracts.errors import ErrorCode
from contracts.jobs import LoadTimings, Residency
from worker import metrics
from worker.adapter_cache import AdapterCache
from worker.config import WorkerSettings
from worker.deadlines import late, remaining_s
from worker.engine import EngineFailed, EngineHost
from worker.errors import AdapterIntegrityError, JobFailure
from worker.inflight import Running

log = logging.getLogger(__name__)

T = TypeVar("T")

SLOT_DRAIN_AFTER_S = cast(float, WorkerSettings.model_fields["slot_drain_after_s"].default)
"""``LORAFLEET_SLOT_DRAIN_AFTER_S``'s default, for an ``EngineAdapters`` built without settings."""

MAX_REFUSED = 1024
"""Refused adapters remembered per process (a digest each; the oldest is forgotten first)."""


@dataclass(frozen=True)
class Resident:
    """An adapter ready in the engine, with the digest of the files it was given."""

    request: LoRARequest
    loaded_digest: str


@dataclass(frozen=True)
class Staged:
    """An adapter on local disk, ready for the engine; ``verified_digest`` is set when its
    files were hashed as they were fetched just now (``None``: found on disk)."""

    request: LoRARequest
    digest: str
    verified_digest: str | None


class _Waiter(NamedTuple):
    lora_id: int
    entry: asyncio.Future[None]
    since: float
    """The gate's clock when the job asked for a slot."""


class SlotGate:
    """Bounds the distinct unpinned adapters with requests in the engine at once.

    vLLM's scheduler admits up to ``max_loras`` distinct adapters per step without counting
    pinned ones, yet pinned adapters keep their GPU slots: a step with ``max_loras`` unpinned
    adapters then has no slot for one of them and the engine fails. Keeping in-flight unpinned
    adapters at ``max_loras - pinned`` makes every step fit.

    Waiters are let in oldest first until one does not fit (which keeps its place). A job
    for an adapter in flight joins it at once, arriving or queued (same adapter, same step:
    batching costs no slot), as vLLM's own scheduler lets it, and an adapter let in from the
    queue takes its whole backlog with it. That alone starves a rare adapter behind popular
    ones that never run out of jobs; so once the job at the head has waited ``drain_after_s``,
    the adapter that has held its slot longest *drains*: it takes no more jobs, its requests
    in the engine run out, and its slot goes to the waiter. The job at the head waits at most
    ``drain_after_s`` plus the time the draining adapter's requests then in the engine take,
    a job further back one such drain per job of another adapter ahead of it (a pin that
    lowers the capacity while jobs are in flight can make it more than one), and the
    engine's batch holds every job whose adapter has a slot but the draining adapter's
    newcomers.

    Until 2026-12-06 every adapter in flight took at most ``LORAFLEET_SLOT_BYPASS_JOBS`` (64)
    joiners past a waiter, then none: of 256 requests at once over 8 adapters and 4 slots,
    ~68 entered the engine at first, where vLLM's scheduler takes the 128 of its 4 adapters.

    Lives on the engine loop: a job waiting for a slot is a coroutine there, let in on the loop
    iteration that frees the slot (no job thread has to wake up first, which at a wave of
    hundreds of finishing jobs took over a second), and its deadline and cancellation apply
    while it waits.
    """

    def __init__(
        self,
        capacity: int,
        *,
        drain_after_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._capacity = capacity
        self._drain_after_s = drain_after_s
        self._clock = clock
        # Jobs in flight per adapter, in the order the adapters took their slots (a dict keeps
        # insertion order; an adapter that drained and comes back is the newest again).
        self._active: Counter[int] = Counter()
        self._waiting: deque[_Waiter] = deque()

    def _fits(self, lora_id: int) -> bool:
        return lora_id in self._active or len(self._active) < self._capacity

    def _draining(self) -> int | None:
        """The adapter giving its slot to the job waiting at the head: the one that has held
        its slot longest, once that job has waited ``drain_after_s`` (none before)."""
        while self._waiting and self._waiting[0].entry.done():  # cancelled while it waited
            self._waiting.popleft()
        if not self._waiting or self._clock() - self._waiting[0].since < self._drain_after_s:
            return None
        return next(iter(self._active), None)

    def _may_enter(self, lora_id: int) -> bool:
        """With nobody waiting, if it fits; else only to join its adapter in flight, unless
        that adapter drains."""
        draining = self._draining()  # drops the cancelled waiters at the head
        if not self._waiting:
            return self._fits(lora_id)
        return lora_id in self._active and lora_id != draining

    def _admit(self) -> None:
        """Let waiters in, oldest first, until one does not fit; then, while that one waits,
        the queued jobs for adapters in flight but the draining one (as if they arrived now:
        a burst queues them behind the first job that did not fit, and left there, the
        engine would run one adapter's jobs at a time while the others drain), and all the
        queued jobs of an adapter given its slot just now, the draining one included (its
        backlog is bounded: it queued before; with one slot, the adapter let in is the one
        that drains next, and without this it would run a single job per slot it takes)."""
        activated: set[int] = set()  # adapters given a slot now: they take their backlog
        while self._waiting:
            lora_id, entry, _ = self._waiting[0]
            if entry.done():  # cancelled while it waited
                self._waiting.popleft()
                continue
            if not self._fits(lora_id):
                break
            self._waiting.popleft()
            if lora_id not in self._active:
                activated.add(lora_id)
            self._active[lora_id] += 1
            entry.set_result(None)
        if not self._waiting:
            return
        draining = self._draining()
        kept: deque[_Waiter] = deque()
        for waiter in self._waiting:  # the head does not fit: not in flight
            lora_id, entry, _ = waiter
            if entry.done():
                continue
            if lora_id in self._active and (lora_id != draining or lora_id in activated):
                self._active[lora_id] += 1
                entry.set_result(None)
            else:
                kept.append(waiter)
        self._waiting = kept

    def _release(self, lora_id: int) -> None:
        self._active[lora_id] -= 1
        if not self._active[lora_id]:
            del self._active[lora_id]
            self._admit()

    def set_capacity(self, capacity: int) -> None:
        self._capacity = capacity
        self._admit()

    def idle_slot(self, lora_id: int) -> bool:
        """A slot no request uses is free now for ``lora_id`` (which no request uses either),
        and nobody waits for one: taking it delays no job."""
        return not self.waiting and lora_id not in self._active and self._fits(lora_id)

    @property
    def waiting(self) -> int:
        """Jobs waiting for a slot now (on the engine loop)."""
        return sum(1 for waiter in self._waiting if not waiter.entry.done())

    @property
    def has_idle_slot(self) -> bool:
        """A slot no request uses, read from any thread (a snapshot)."""
        return len(self._active) < self._capacity

    @property
    def queued(self) -> int:
        """Waiters, some perhaps already cancelled: safe to read from any thread (the
        length of a deque is read atomically; iterating it while the loop changes it is
        not)."""
        return len(self._waiting)

    @asynccontextmanager
    async def slot(self, lora_id: int) -> AsyncIterator[None]:
        if self._may_enter(lora_id):
            self._active[lora_id] += 1
        else:
            entry = asyncio.get_running_loop().create_future()
            self._waiting.append(_Waiter(lora_id, entry, self._clock()))
            try:
                await entry
            except asyncio.CancelledError:
                if entry.done() and not entry.cancelled():
                    self._release(lora_id)  # let in, then cancelled before it resumed
                else:
                    self._admit()  # it may have been the head that held the others back
                raise
        try:
            yield
        finally:
            self._release(lora_id)


class SharedQuestion:
    """One engine round trip answers every caller that asked before it started.

    Each ``list_loras`` is a request to the engine-core process, served between steps; with
    hundreds of jobs starting at once, one each would delay them all. A caller joins the round
    not yet sent (or opens one); a round is sent on the next loop iteration, so its answer is
    never older than any of its callers' questions. Runs on the engine loop only.
    """

    def __init__(self, ask: Callable[[], Awaitable[Iterable[int]]]) -> None:
        self._ask = ask
        self._pending: asyncio.Future[set[int]] | None = None
        self._sending: set[asyncio.Task[None]] = set()  # strong references until done

    async def ask(self) -> set[int]:
        if self._pending is None:
            self._pending = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_soon(self._send)
        return await asyncio.shield(self._pending)

    def _send(self) -> None:
        round_, self._pending = self._pending, None  # later callers open the next round
        assert round_ is not None

        async def answer() -> None:
            try:
                round_.set_result(set(await self._ask()))
            except Exception as exc:
                round_.set_exception(exc)

        task = asyncio.get_running_loop().create_task(answer())
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)


class EngineAdapters:
    """Makes verified adapters resident in the engine, once per digest at a time."""

    def __init__(
        self,
        host: EngineHost,
        cache: AdapterCache,
        max_loras: int,
        max_cpu_loras: int | None = None,
        slot_drain_after_s: float = SLOT_DRAIN_AFTER_S,
    ) -> None:
        self._host = host
        self._cache = cache
        self._max_loras = max_loras
        self._max_cpu_loras = max_cpu_loras  # None: nothing is registered ahead of its jobs
        self._guard = threading.Lock()
        self._ids: dict[str, int] = {}
        self._last_id = 0  # ids are never reused, though digests are forgotten (``prune``)
        self._handed: dict[int, str] = {}
        self._pinned: set[int] = set()
        # Jobs of a pinned adapter in the engine now: they hold no gate slot, so an unpin
        # waits for them before the adapter's slot is counted as the gate's again.
        self._pinned_users: Counter[int] = Counter()  # on the engine loop
        self._loading: dict[str, asyncio.Lock] = {}  # on the engine loop
        self._refused: dict[str, str] = {}  # digest -> the engine's refusal, oldest first
        self._gate = SlotGate(max_loras, drain_after_s=slot_drain_after_s)
        self._listing = SharedQuestion(lambda: self._host.engine.list_loras())
        # The engine's last answer, kept while nothing that could change it happened since.
        self._known: set[int] | None = None
        self._generation = 0
        # Adapter ids of the requests in the engine now. An answer lacking one of them is
        # not kept: the engine loads that adapter when it schedules its request, evicting
        # another, so the answer is about to change.
        self._in_engine: Counter[int] = Counter()
        self.on_change: Callable[[], None] = lambda: None
        """Called (``_guard`` held: it must not block) when the engine's adapters may have
        changed."""
        self.on_proven: Callable[[str], None] = lambda digest: None
        """Called (on the engine loop: it must not block) with a digest the engine loaded and
        survived: it may be registered ahead of its jobs on other workers too."""

    def _id_for(self, digest: str) -> int:
        with self._guard:
            if digest not in self._ids:
                self._last_id += 1
                self._ids[digest] = self._last_id
            return self._ids[digest]

    def prune(self, timeout_s: float) -> int:
        """Forget what is kept per digest (its engine id, the digest the engine was handed,
        its load lock) for every adapter that left every level: not in the engine (its own
        answer, as ``registered``), not pinned, not on disk, held by nothing, not being
        downloaded. Over weeks of new revisions these maps would otherwise only grow. A digest
        asked for again gets a new id (the engine no longer holds the old one). How many were
        forgotten."""
        with self._guard:
            generation = self._generation
        try:
            held = self.registered(time.time() + timeout_s)
        except (JobFailure, EngineFailed):
            return 0
        forgotten = 0
        with self._guard:  # a job takes its hold before it asks for an id: checked under it
            if self._generation != generation:
                return 0  # the engine's set may have changed since it answered: next time
            for digest, lora_id in list(self._ids.items()):
                if (
                    lora_id in held
                    or lora_id in self._pinned
                    or lora_id in self._in_engine
                    or self._cache.in_use(digest)
                ):
                    continue
                lock = self._loading.get(digest)
                if lock is not None and lock.locked():
                    continue
                del self._ids[digest]
                self._handed.pop(lora_id, None)
                self._loading.pop(digest, None)
                forgotten += 1
        return forgotten

    def request_for(self, alias: str, digest: str) -> LoRARequest:
        return LoRARequest(
            lora_name=f"{alias}@{short(digest)}",
            lora_int_id=self._id_for(digest),
            lora_path=str(self._cache.path_for(digest)),
        )

    def registered(self, deadline_at: float | None = None) -> set[int]:
        """Adapter ids the engine holds right now (its own answer, not our bookkeeping).

        The engine's set changes only when it is asked to load an adapter (``add_lora``, a pin,
        or a request naming an adapter it does not hold, which it loads from its path): its
        answer is kept until one of those happens (``changing``, ``entering``), and asked again
        after, no earlier than this call; concurrent callers share one question to the engine.
        An answer that lacks the adapter of a request in the engine is used once, not kept
        (the engine loads it when it schedules that request, not when it is handed it). Past
        ``deadline_at`` (unix time) waiting for the answer fails ``deadline_exceeded``.
        """
        with self._guard:
            known, generation = self._known, self._generation
        if known is not None:
            return known
        try:
            answer = self._host.run(self._listing.ask(), remaining_s(deadline_at))
        except TimeoutError:
            raise late("asked the engine which adapters it holds") from None
        return self._keep(answer, generation)

    async def registered_on_loop(self) -> set[int]:
        """``registered``, asked on the engine loop (the caller's deadline applies)."""
        with self._guard:
            known, generation = self._known, self._generation
        if known is not None:
            return known
        return self._keep(await self._listing.ask(), generation)

    def _keep(self, answer: set[int], generation: int) -> set[int]:
        with self._guard:
            if self._generation == generation and self._in_engine.keys() <= answer:
                self._known = answer
        return answer

    def changing(self) -> None:
        """The engine's set of adapters may change now: forget its last answer."""
        with self._guard:
            self._forget()

    def _forget(self) -> None:
        """``changing``, with ``_guard`` held."""
        self._generation += 1
        self._known = None
        self.on_change()

    @contextmanager
    def entering(self, request: LoRARequest) -> Iterator[None]:
        """Around a request for ``request``'s adapter in the engine, which loads the adapter
        from its path (evicting another) if it is not among those it holds when it schedules
        the request: a kept answer without it is forgotten, and no answer without it is kept
        until the request has ended."""
        lora_id = request.lora_int_id
        with self._guard:
            self._in_engine[lora_id] += 1
            if self._known is not None and lora_id not in self._known:
                self._forget()
        try:
            yield
        finally:
            with self._guard:
                self._in_engine[lora_id] -= 1
                if not self._in_engine[lora_id]:
                    del self._in_engine[lora_id]
                if self._known is None or lora_id not in self._known:
                    # It may have loaded its adapter: an answer asked before that, still on
                    # its way back, must not be kept now that nothing in the engine lacks.
                    self._forget()

    def levels(self, timeout_s: float) -> dict[str, str] | None:
        """Digest -> ``pinned`` or ``engine`` of every adapter the engine holds now (its own
        answer, as ``registered``); ``None`` if it did not answer within ``timeout_s``."""
        try:
            held = self.registered(time.time() + timeout_s)
        except (JobFailure, EngineFailed):
            return None
        with self._guard:
            digests = {lora_id: digest for digest, lora_id in self._ids.items()}
            pinned = set(self._pinned)
        return {
            digests[lora_id]: "pinned" if lora_id in pinned else "engine"
            for lora_id in held
            if lora_id in digests
        }

    def observe(self, digest: str, registered: set[int]) -> Residency:
        """Residency of ``digest`` given the engine's ``registered`` ids (just asked)."""
        lora_id = self._id_for(digest)
        if lora_id in registered:
            return "gpu" if lora_id in self._pinned else "cpu"
        return "disk" if self._cache.has(digest) else "remote"

    def stage(
        self,
        alias: str,
        digest: str,
        timings: LoadTimings,
        deadline_at: float | None = None,
        running: Running | None = None,
        count: bool = True,
    ) -> Staged:
        """Ensure ``digest`` is on local disk (fetched and verified as it streams if it was
        not), ready for ``load``; the caller holds it in the disk cache until then.

        On disk in every case, even when the engine has it: vLLM reloads from this path
        should it drop the adapter from its own cache. ``timings`` receives the phases this
        call ran (fetch, verify). The download and the wait for disk space end by
        ``deadline_at`` (unix time), or when ``running`` (the job's attempt) is stopped.
        """
        check = running.check if running is not None else None
        fetched = self._cache.ensure(digest, deadline_at, check, count)
        timings.fetch, timings.verify = fetched.fetch_ms, fetched.verify_ms
        return Staged(self.request_for(alias, digest), digest, fetched.loaded_digest)

    async def load(
        self,
        staged: Staged,
        timings: LoadTimings,
        deadline_at: float | None = None,
        running: Running | None = None,
    ) -> Resident:
        """On the engine loop: make ``staged`` resident in the engine from verified files.

        A job calls this holding its GPU adapter slot (``slot``), never before: ``add_lora``
        activates the adapter into a GPU slot at once, evicting the least recently used
        unpinned one, so a job that loaded and then waited for a slot took the slot of a job
        that was generating, and the engine's next step swapped it back. Files found on disk
        are hashed again (in a thread) before the engine reads them; files that no longer
        match are fetched again. ``timings`` receives verify (when hashed here) and
        engine_load. ``running`` (none when preloading): an engine that dies while it loads
        this job's adapter is counted against the job (``in_engine``).
        """
        request, digest = staged.request, staged.digest
        lora_id = request.lora_int_id
        if lora_id in await self.registered_on_loop() and lora_id in self._handed:
            return Resident(request, self._handed[lora_id])
        lock = self._loading.setdefault(digest, asyncio.Lock())
        async with lock:
            # Asked again: another job may have loaded it while this one waited for the lock.
            registered = await self.registered_on_loop()
            if lora_id in registered and lora_id in self._handed:
                return Resident(request, self._handed[lora_id])
            loaded = staged.verified_digest
            if loaded is None:
                loaded = await asyncio.to_thread(
                    self._verify_or_fetch_again, digest, timings, deadline_at
                )
            if loaded != digest:
                raise AdapterIntegrityError(f"Files for {digest} hash to {loaded}; refused.")
            start = time.perf_counter()
            await self._load(request, digest, running)
            timings.engine_load = round((time.perf_counter() - start) * 1000, 3)
            self._handed[lora_id] = loaded
            # The engine's CPU cache makes room by dropping its least recently used adapter.
            dropped = registered - await self.registered_on_loop()
            if dropped:
                metrics.EVICTIONS.labels("cpu").inc(len(dropped))
        return Resident(request, loaded)

    def make_resident(
        self, alias: str, digest: str, timings: LoadTimings, deadline_at: float | None = None
    ) -> Resident:
        """``stage`` then ``load``, from a thread that holds no slot (preloading at start)."""
        staged = self.stage(alias, digest, timings, deadline_at)
        try:
            return self._host.run(self.load(staged, timings, deadline_at), remaining_s(deadline_at))
        except TimeoutError:
            raise late("waited for the engine to load its adapter") from None

    async def _load(self, request: LoRARequest, digest: str, running: Running | None) -> None:
        """``add_lora``, once per digest that the engine refuses: its files never change and
        neither does the engine, so a refusal is final for this process (and retrying it
        could only cost every job of that adapter a load, or worse, the engine).

        While the engine loads it, the job counts as in the engine: an adapter whose load
        kills the engine every time is stopped by ``attempts_exhausted`` as a prompt that
        does would be. A job that finds the engine already dead does not count it."""
        refused = self._refused.get(digest)
        if refused is None:
            if running is not None:
                self._host.check_serving()
                running.in_engine = True
            self.changing()
            try:
                try:
                    await self._engine_reads(digest, self._host.engine.add_lora(request))
                finally:
                    self.changing()  # an answer given while it loaded may predate the load
                if running is not None:
                    running.in_engine = False  # loaded: the engine survived this adapter
                self.on_proven(digest)
                return
            except EngineDeadError as exc:
                raise self._host.died(exc) from exc
            except EngineFailed:
                raise
            except Exception as exc:  # the engine's own refusal (it keeps serving the others)
                refused = str(exc) or type(exc).__name__
                with self._guard:
                    self._refused[digest] = refused
                    while len(self._refused) > MAX_REFUSED:
                        self._refused.pop(next(iter(self._refused)))
                log.error("engine refused adapter %s: %s", request.lora_name, refused)
        raise JobFailure(
            ErrorCode.ADAPTER_LOAD_FAILED,
            f"The engine could not load adapter {request.lora_name}: {refused}. The job did "
            "not run; the engine keeps serving other adapters.",
        )

    async def _engine_reads(self, digest: str, reading: Awaitable[T]) -> T:
        """Await ``reading`` (the engine reading ``digest``'s files), keeping the files on
        disk until the engine has answered, even if the caller is cancelled meanwhile (a job
        past its deadline, a prefetch that timed out): cancelling the wait does not stop the
        engine core, which must not find them evicted halfway."""
        hold = self._cache.hold(digest)
        hold.__enter__()
        task = asyncio.ensure_future(reading)

        def release(done: asyncio.Future[T]) -> None:
            if not done.cancelled():
                done.exception()  # the caller may be gone: read here, not logged as lost
            # Letting go may delete quarantined files: not on the engine loop.
            asyncio.get_running_loop().run_in_executor(None, hold.__exit__, None, None, None)

        task.add_done_callback(release)
        return await asyncio.shield(task)

    def _verify_or_fetch_again(
        self, digest: str, timings: LoadTimings, deadline_at: float | None
    ) -> str:
        """The digest of the cached files, re-hashed. Files that no longer match (or that
        another job quarantined meanwhile) are fetched again from the store, verified as
        they stream; the store's copy failing too fails the job ``adapter_integrity``."""
        try:
            loaded, timings.verify = self._cache.verify(digest)
            return loaded
        except AdapterIntegrityError as mismatch:
            log.error("%s; fetching it again", mismatch.message)
        fetched = self._cache.ensure(digest, deadline_at)
        timings.fetch, timings.verify = fetched.fetch_ms, fetched.verify_ms
        if fetched.loaded_digest is not None:
            return fetched.loaded_digest
        loaded, timings.verify = self._cache.verify(digest)
        return loaded

    def engine_has_room(self, timeout_s: float = 5.0) -> bool:
        """Registering one more adapter now would evict nothing from the engine's CPU cache
        and take no GPU slot a waiting job is owed (its own answer, as ``registered``)."""
        if self._max_cpu_loras is None or self._gate.queued or not self._gate.has_idle_slot:
            return False
        try:
            held = self.registered(time.time() + timeout_s)
        except (JobFailure, EngineFailed):
            return False
        return len(held) < self._max_cpu_loras

    def holds(self, digest: str, timeout_s: float = 5.0) -> bool:
        """The engine holds ``digest`` now (as ``registered``; False if it did not say)."""
        with self._guard:
            lora_id = self._ids.get(digest)
        if lora_id is None:
            return False
        try:
            return lora_id in self.registered(time.time() + timeout_s)
        except (JobFailure, EngineFailed):
            return False

    def prefetch_into_engine(
        self,
        alias: str,
        digest: str,
        verified_digest: str | None,
        loading: Callable[[bool], None] = lambda started: None,
        timeout_s: float = 10.0,
    ) -> bool:
        """Register ``digest`` (on disk, held by the caller) in the engine ahead of its jobs,
        only while that costs nothing: a free place in the engine's CPU cache (nothing is
        evicted; checked again once in the slot) and a GPU slot no request uses, with no job
        waiting for one (``add_lora`` activates the adapter into a slot at once: it takes the
        slot through the gate, as a job would, and gives it back once loaded).
        ``verified_digest``: what the caller's hash of the files on disk gave, just now (the
        hashing is done before taking the slot; the engine is handed only files that hash
        to ``digest``). True if this call registered it.

        ``loading(True)`` is called on the engine loop once it is decided (the adapter not
        in the engine, nothing else can register it first), before the load, so that a job
        that finds it there can tell who put it there; ``loading(False)`` if the load
        failed."""
        if self._max_cpu_loras is None:
            return False
        if verified_digest != digest:
            raise AdapterIntegrityError(f"Files for {digest} hash to {verified_digest}; refused.")
        max_cpu = self._max_cpu_loras
        staged = Staged(self.request_for(alias, digest), digest, verified_digest)
        lora_id = staged.request.lora_int_id

        async def register() -> bool:
            registered = await self.registered_on_loop()
            if lora_id in registered or len(registered) >= max_cpu:
                return False
            if not self._gate.idle_slot(lora_id):
                return False
            async with self._gate.slot(lora_id):
                registered = await self.registered_on_loop()
                if lora_id in registered or len(registered) >= max_cpu:
                    return False
                loading(True)
                timings = LoadTimings()
                try:
                    await self.load(staged, timings, time.time() + timeout_s)
                except BaseException:
                    loading(False)
                    raise
                if timings.engine_load is None:  # a job's load got there first: not ours
                    loading(False)
                    return False
            return True

        return self._host.run(register(), timeout_s)

    def pin(self, alias: str, digest: str) -> Resident:
        """Load ``digest`` into a GPU slot for good (the caller keeps it held on disk)."""
        if len(self._pinned) + 1 >= self._max_loras:
            raise RuntimeError(
                f"pinning {alias} would leave no free GPU adapter slot (max_loras="
                f"{self._max_loras}, already pinned {len(self._pinned)})"
            )
        resident = self.make_resident(alias, digest, LoadTimings())
        try:
            self._host.run(self._host.engine.pin_lora(resident.request.lora_int_id))
        finally:
            self.changing()
        self._pinned.add(resident.request.lora_int_id)
        capacity = self._max_loras - len(self._pinned)

        async def resize() -> None:
            self._gate.set_capacity(capacity)

        self._host.run(resize())
        return resident

    @asynccontextmanager
    async def slot(self, request: LoRARequest) -> AsyncIterator[None]:
        """On the engine loop: hold a GPU slot for ``request``'s adapter while it has a
        request in the engine (pinned adapters own theirs)."""
        lora_id = request.lora_int_id
        if lora_id in self._pinned:
            self._pinned_users[lora_id] += 1
            try:
                yield
            finally:
                self._pinned_users[lora_id] -= 1
                if not self._pinned_users[lora_id]:
                    del self._pinned_users[lora_id]
            return
        async with self._gate.slot(lora_id):
            yield

    @property
    def pinned_digests(self) -> set[str]:
        """Digests pinned in GPU slots now."""
        with self._guard:
            return {digest for digest, lora_id in self._ids.items() if lora_id in self._pinned}

    def pin_live(self, alias: str, digest: str, timeout_s: float) -> Resident:
        """Pin ``digest`` while jobs run (a hot adapter published to a live worker; the caller
        holds it on disk). Fetched and verified in this thread, like a job's adapter; then on
        the engine loop it waits its turn for a GPU slot at the gate as a job would (first in,
        first out), loads inside it (never evicting an adapter a job is generating with) and
        pins: from then on its slot is its own and the gate has one fewer. ``TimeoutError``
        past ``timeout_s`` (nothing pinned)."""
        staged = self.stage(alias, digest, LoadTimings(), time.time() + timeout_s)
        lora_id = staged.request.lora_int_id

        async def pin() -> Resident:
            if lora_id in self._pinned:
                return Resident(staged.request, self._handed[lora_id])
            if len(self._pinned) + 1 >= self._max_loras:
                raise RuntimeError(
                    f"pinning {alias} would leave no free GPU adapter slot (max_loras="
                    f"{self._max_loras}, already pinned {len(self._pinned)})"
                )
            async with self._gate.slot(lora_id):
                resident = await self.load(staged, LoadTimings())
                # Once the engine is asked to pin, the pin and its count end before the slot
                # is let go, even if this wait is given up: the gate must never let an adapter
                # in while the engine holds one more pinned than it has counted.
                pinning = asyncio.ensure_future(pin_and_count())
                try:
                    await asyncio.shield(pinning)
                except asyncio.CancelledError:
                    await asyncio.wait({pinning})
                    raise
            return resident

        async def pin_and_count() -> None:
            self.changing()
            try:
                await self._host.engine.pin_lora(lora_id)
            finally:
                self.changing()
            self._pinned.add(lora_id)
            self._gate.set_capacity(self._max_loras - len(self._pinned))

        return self._host.run(pin(), timeout_s)

    def unpin(self, digest: str) -> bool:
        """Unpin ``digest`` (its hot adapter was retired): new jobs of it take a gate slot like
        any adapter's at once; once the jobs that ran on it pinned have left the engine, the
        engine drops it (vLLM has no unpin: ``remove_lora`` frees its GPU and CPU slots, a
        later job loads it again from disk, and a job of it already in the engine through the
        gate reloads it there) and the gate gets the slot back. Waits as long as those jobs
        run (each ends by its deadline); False if it was not pinned."""
        with self._guard:
            lora_id = self._ids.get(digest)
        if lora_id is None:
            return False

        async def release() -> bool:
            if lora_id not in self._pinned:
                return False
            self._pinned.discard(lora_id)
            self.changing()  # announced as held in the engine now, not pinned
            try:
                while self._pinned_users[lora_id]:
                    await asyncio.sleep(0.05)
                async with self._loading.setdefault(digest, asyncio.Lock()):
                    self.changing()
                    try:
                        await self._host.engine.remove_lora(lora_id)
                    finally:
                        self.changing()
                    self._handed.pop(lora_id, None)
            except BaseException:
                self._pinned.add(lora_id)  # maybe still pinned in the engine: counted as such
                raise
            self._gate.set_capacity(self._max_loras - len(self._pinned))
            return True

        return self._host.run(release())
