"""One soak run: the stack with a persistent Redis, S3 behind a proxy that can go down, the
gateway, a webhook worker and ``workers`` job workers, all restarted by a supervisor when
they exit; the traffic for ``duration_s``; then the drain, the retention wait and the checks.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from contracts.queues import Tier
from contracts.tenants import ALL_ADAPTERS, TenantLimits
from contracts.webhooks import batch_event_id, job_event_id
from lorafleet.experiment.cold_swap import Adapter, ColdSwapModel
from lorafleet.fixtures import write_fixtures
from lorafleet.processes import free_port, wait_until
from lorafleet.settings import LocalSettings
from lorafleet.soak.checks import (
    Reference,
    Verdict,
    check_outcomes,
    check_records,
    check_webhooks,
    per_minute,
    recovery,
)
from lorafleet.soak.faults import Supervisor, TcpProxy, schedule_for
from lorafleet.soak.observe import Observer
from lorafleet.soak.receiver import FlappingReceiver
from lorafleet.soak.workload import MAX_TOKENS, PROMPTS, Caller, Mix, Traffic
from lorafleet.stack import LocalStack
from lorafleet.tenants import Tenants

TIERS = [Tier.HOT] * 2 + [Tier.WARM] * 4 + [Tier.COLD] * 6
DEADLINE_S = 45
"""Short, so that a job that waits through a fault ends (``deadline_exceeded`` at worst)
within a short run."""
SWEEP_GRACE_S = 2
SWEEP_INTERVAL_S = 1
KEY_GROWTH_BOUND = 50
"""Keys the run may leave beyond its start once retention passed: announcements of the
workers that replaced killed ones (they expire within seconds), the tenants' rate buckets."""
MEMORY_GROWTH_BOUND_BYTES = 4 * 2**20
RESTORE_WAIT_S = 240.0
"""How long the end of a run waits for the last fault's part to be back (a worker start
takes 20-80 s on this loaded machine)."""


@dataclass(frozen=True)
class SoakConfig:
    state_dir: Path
    duration_s: float = 1800.0
    rate_per_s: float = 4.0
    retention_s: int = 300
    workers: int = 2
    faults: bool = True
    worker_kill_every_s: float | None = 300.0
    seed: int = 7

    def __post_init__(self) -> None:
        # The services refuse a retention their unfinished jobs' records would not outlive.
        floor = DEADLINE_S + SWEEP_GRACE_S + SWEEP_INTERVAL_S + 10
        if self.retention_s < floor:
            raise ValueError(
                f"retention_s must be at least {floor} s (the job deadline is {DEADLINE_S} s), "
                f"not {self.retention_s}"
            )

    @property
    def webhook_window_s(self) -> int:
        """Webhook retries stop well before the events' records expire (settings refuse a
        window as long as the retention)."""
        return min(120, self.retention_s - 15)


def service_env(config: SoakConfig) -> dict[str, str]:
    """Production settings but for short timeouts (so faults resolve within a short run) and
    the retention (so the key space's return can be watched)."""
    retention = str(config.retention_s)
    return {
        "LORAFLEET_JOB_TTL_S": retention,
        "LORAFLEET_FILE_TTL_S": retention,
        "LORAFLEET_IDEMPOTENCY_TTL_S": retention,
        "LORAFLEET_JOB_DEADLINE_S": str(DEADLINE_S),
        "LORAFLEET_VISIBILITY_TIMEOUT_S": str(DEADLINE_S + 15),
        "LORAFLEET_HEARTBEAT_S": "1",
        "LORAFLEET_RESTORE_INTERVAL_S": "1",
        "LORAFLEET_LEASE_TTL_S": "8",
        "LORAFLEET_ENGINE_PROBE_S": "1",
        "LORAFLEET_ENGINE_PROBE_TIMEOUT_S": "30",
        "LORAFLEET_ENGINE_FAILURE_EXIT_S": "30",
        "LORAFLEET_SWEEP_INTERVAL_S": str(SWEEP_INTERVAL_S),
        "LORAFLEET_SWEEP_GRACE_S": str(SWEEP_GRACE_S),
        "LORAFLEET_WORKER_CONCURRENCY": "32",
        "LORAFLEET_MAX_LORAS": "3",
        "LORAFLEET_MAX_CPU_LORAS": "4",
        "LORAFLEET_DISK_CACHE_BYTES": "400000",
        "LORAFLEET_DRAIN_TIMEOUT_S": "30",
        "LORAFLEET_WEBHOOK_BACKOFF_S": "0.5",
        # Retries at most 4 s apart: a window this short must not run out against the
        # receiver's flaps by chance (a 105 s window with doubling backoff once did).
        "LORAFLEET_WEBHOOK_BACKOFF_MAX_S": "4",
        "LORAFLEET_WEBHOOK_RETRY_WINDOW_S": str(config.webhook_window_s),
        "LORAFLEET_WEBHOOK_POLL_S": "0.2",
        "LORAFLEET_WEBHOOK_TIMEOUT_S": "5",
        # Every result goes to S3 (they are about 200 bytes): the S3 outage meets result
        # writes and reads as well as adapter fetches.
        "LORAFLEET_RESULT_OFFLOAD_BYTES": "64",
    }


@dataclass
class SoakResult:
    config: dict[str, Any]
    verdict: Verdict
    minutes: list[dict[str, Any]]
    faults: list[dict[str, Any]]
    restarts: list[tuple[float, str, int | None]]
    memory: dict[str, Any]
    rss: list[dict[str, Any]]
    timeline: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        body = {
            "config": self.config,
            "violations": self.verdict.violations,
            "counts": dict(self.verdict.counts),
            "refusals": dict(self.verdict.refusals),
            "job_errors": dict(self.verdict.job_errors),
            "attempts": {str(k): v for k, v in sorted(self.verdict.attempts.items())},
            "minutes": self.minutes,
            "faults": self.faults,
            "restarts": self.restarts,
            "memory": self.memory,
            "rss": self.rss,
            "timeline": self.timeline,
        }
        return json.dumps(body, indent=2, default=str)


def references(fixtures: Path, revisions: dict[str, str]) -> dict[tuple[str, int], Reference]:
    """Greedy tokens of every (adapter, prompt) from transformers + PEFT on the same files."""
    adapters = {
        alias: Adapter(alias, fixtures / "adapters" / alias, revision)
        for alias, revision in revisions.items()
    }
    model = ColdSwapModel(fixtures / "base", adapters)
    out = {}
    for alias in adapters:
        model.swap(alias)
        for i, prompt in enumerate(PROMPTS):
            tokens = tuple(model.tokens(prompt, MAX_TOKENS))
            text = str(model.tokenizer.decode(list(tokens), skip_special_tokens=True))
            out[(alias, i)] = Reference(tokens, text.rstrip("\ufffd"))
    return out


def run_soak(config: SoakConfig, say: Callable[[str], None] = print) -> SoakResult:
    fixtures = config.state_dir / "fixtures"
    specs = write_fixtures(fixtures, adapters=len(TIERS))
    settings = LocalSettings(
        state_dir=config.state_dir / "stack",
        s3_bucket="lorafleet-soak",
        redis_url=None,
        s3_endpoint_url=None,
        gateway_port=free_port(),
    )
    stack = LocalStack(settings, fixtures / "base", persistent_redis=True)
    proxy: TcpProxy | None = None
    receiver: FlappingReceiver | None = None
    supervisor: Supervisor | None = None
    observer: Observer | None = None
    try:
        stack.start_infra()
        publisher = stack.publisher()
        revisions = {}
        tiers = {}
        for spec, tier in zip(specs, TIERS, strict=True):
            record = publisher.publish(fixtures / "adapters" / spec.name, spec.name, tier)
            revisions[spec.name] = record.digest
            tiers[spec.name] = tier.value
        say(f"references: transformers + PEFT, {len(revisions)} adapters x {len(PROMPTS)} prompts")
        refs = references(fixtures, revisions)

        moto = urlparse(stack.s3_endpoint_url)
        proxy = TcpProxy((str(moto.hostname), int(moto.port or 80)))
        proxy.up()
        stack.s3_endpoint_url = proxy.url  # the services reach S3 through the proxy

        tenants = Tenants(stack.redis())
        callers, secrets = [], []
        for name, weight, limits in (
            ("soak-a", 0.6, None),
            ("soak-b", 0.35, None),
            # refused often (429): the stable codes of refusals are checked too
            ("soak-limited", 0.05, TenantLimits(rate_per_s=0.05, burst=1)),
        ):
            _, key = tenants.create(name, limits)
            tenants.grant(name, ALL_ADAPTERS)
            callers.append(Caller(name, key, weight))
            secrets.append(tenants.webhook_secrets(name).secrets[0].secret)
        receiver = FlappingReceiver(secrets)
        receiver.start()

        env = service_env(config)
        t0 = [time.monotonic()]

        def clock() -> float:
            return time.monotonic() - t0[0]

        schedule = (
            schedule_for(config.duration_s, config.worker_kill_every_s) if config.faults else []
        )
        supervisor = Supervisor(stack, proxy, env, env, clock, schedule)
        say(f"starting the gateway, the webhook worker and {config.workers} workers")
        gateway = stack.spawn_gateway(env)
        stack.spawn_webhooks(env)
        workers = [supervisor.spawn_worker() for _ in range(config.workers)]
        wait_until(stack.gateway_ready, settings.startup_timeout_s, "the gateway", [gateway])
        for worker in workers:
            stack.wait_worker(worker)
        redis = stack.redis()
        baseline_keys = {str(k) for k in redis.scan_iter(count=1000)}
        baseline = (int(redis.info("memory")["used_memory"]), len(baseline_keys))

        observer = Observer(stack, clock)
        traffic = Traffic(
            stack.gateway_url,
            Mix(tuple(callers), tiers),
            config.rate_per_s,
            receiver.url(),
            timeout_s=DEADLINE_S + 60,  # past any job's end: a caller never gives up first
            seed=config.seed,
        )
        t0[0] = time.monotonic()
        # One clock for traffic and faults: CI once saw a stream cut by the gateway kill
        # stamped 0.1 s before the kill, by a traffic clock started that much later.
        traffic.started = t0[0]
        observer.start()
        supervisor.start()
        say(
            f"traffic: {config.rate_per_s}/s for {config.duration_s:.0f} s; faults at "
            + ", ".join(f"{at:.0f} s {name}" for at, name in schedule)
        )
        asyncio.run(_with_progress(traffic, config.duration_s, DEADLINE_S + 60, say))

        say("waiting for the webhook deliveries to settle")
        _settle_webhooks(traffic, receiver, config.webhook_window_s + 30)
        settled_at = clock()
        supervisor.wait_restored(RESTORE_WAIT_S)
        supervisor.quiesce()
        verdict = Verdict()
        kills = [f.at_s for f in supervisor.faults if f.name == "gateway_kill"]
        check_outcomes(traffic.outcomes, refs, revisions, kills, verdict)
        check_webhooks(traffic.outcomes, receiver.deliveries(), verdict)
        check_records(traffic.outcomes, observer.final_statuses(), verdict)
        for error in supervisor.errors:
            verdict.fail(f"the supervisor: {error}")

        # Records expire job_ttl_s after their last change: the last webhook delivery's.
        wait_s = max(0.0, settled_at + config.retention_s + 15 - clock())
        say(f"waiting {wait_s:.0f} s for the retention ({config.retention_s} s) to pass")
        time.sleep(wait_s)
        observer.stop()
        observer.sample()
        memory = _memory(stack, baseline, baseline_keys, verdict)
        return SoakResult(
            config={k: str(v) for k, v in asdict(config).items()},
            verdict=verdict,
            minutes=per_minute(traffic.outcomes),
            faults=recovery(supervisor.faults, traffic.outcomes),
            restarts=supervisor.restarts,
            memory=memory,
            rss=_rss(observer),
            timeline=observer.dump(),
        )
    finally:
        if observer is not None:
            observer.stop()
        if supervisor is not None:
            supervisor.quiesce()
        if receiver is not None:
            receiver.stop()
        stack.stop()
        if supervisor is not None:
            supervisor.stop()
        if proxy is not None:
            proxy.down()


async def _with_progress(
    traffic: Traffic, duration_s: float, finish_by_s: float, say: Callable[[str], None]
) -> None:
    async def report() -> None:
        while True:
            await asyncio.sleep(30)
            done = sum(o.done_at is not None for o in traffic.outcomes)
            say(f"  {traffic.now():.0f} s: {len(traffic.outcomes)} sent, {done} answered")

    reporter = asyncio.create_task(report())
    try:
        await traffic.run(duration_s, finish_by_s)
    finally:
        reporter.cancel()


def _settle_webhooks(traffic: Traffic, receiver: FlappingReceiver, timeout_s: float) -> None:
    """Until every accepted job with a webhook and every batch has had a 2xx call (or the
    retry window has surely ended)."""
    events = [job_event_id(j) for o in traffic.outcomes if o.kind == "job_webhook" for j in o.jobs]
    events += [batch_event_id(o.batch_id) for o in traffic.outcomes if o.batch_id and o.batch]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        calls = receiver.deliveries()
        if all(any(200 <= c.answered < 300 for c in calls.get(e, [])) for e in events):
            time.sleep(5)  # a duplicate would come within the backoff: give it the chance
            return
        time.sleep(1)


def _memory(
    stack: LocalStack, baseline: tuple[int, int], baseline_keys: set[str], verdict: Verdict
) -> dict[str, Any]:
    redis = stack.redis()
    used = int(redis.info("memory")["used_memory"])
    keys = {str(k) for k in redis.scan_iter(count=1000)}
    new = sorted(keys - baseline_keys)
    lasting = [k for k in new if int(redis.ttl(k)) == -1]  # type: ignore[arg-type]
    growth = used - baseline[0]
    if lasting:
        verdict.fail(f"{len(lasting)} keys written during the run never expire: {lasting[:20]}")
    if len(keys) - baseline[1] > KEY_GROWTH_BOUND:
        verdict.fail(f"{len(keys) - baseline[1]} more keys than at the start: {new[:20]}")
    if growth > MEMORY_GROWTH_BOUND_BYTES:
        verdict.fail(f"Redis used_memory grew {growth / 2**20:.1f} MiB over the run")
    return {
        "used_memory_start": baseline[0],
        "used_memory_end": used,
        "keys_start": baseline[1],
        "keys_end": len(keys),
        "new_keys": new[:50],
        "new_keys_without_ttl": lasting[:50],
    }


def _rss(observer: Observer) -> list[dict[str, Any]]:
    rows = []
    for series in observer.rss.values():
        slope = series.slope_per_h()
        rows.append(
            {
                "process": series.name,
                "role": series.role,
                "pid": series.pid,
                "life_s": round(series.life_s),
                "rss_start_mb": round(series.points[0][1], 1),
                "rss_end_mb": round(series.points[-1][1], 1),
                "slope_mb_per_h": None if slope is None else round(slope, 1),
            }
        )
    return rows
