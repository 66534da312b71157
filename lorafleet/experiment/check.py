"""``lorafleet experiment check``: the routing and cold-load acceptance checklist, run.

Each check prints pass or fail with the evidence it observed: status codes and error codes,
job records counted in the job store, worker-side metadata (which digest the worker loaded,
where the adapter was before, which load phases ran), reference tokens from transformers +
PEFT, and worker memory. Locally it starts its own stack with a small resident working set;
against a deployment (``--gateway``) it runs the checks that need no operator access to the
registry, the object store or the workers, and says which it skipped and why.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from contracts.queues import Tier
from contracts.registry import AdapterRecord
from lorafleet.settings import LocalSettings

PROMPT = "Summarise the conversation in one sentence for the support ticket."
GREEDY: dict[str, Any] = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
CHECK_ENV = {
    # A resident working set of two: six adapters overflow it.
    "LORAFLEET_MAX_LORAS": "2",
    "LORAFLEET_MAX_CPU_LORAS": "2",
    "LORAFLEET_WORKER_CONCURRENCY": "32",
    "LORAFLEET_HEARTBEAT_S": "1",
}
CANCEL_ROUNDS = 4
STREAMS_PER_ROUND = 8
# Worker memory may settle during the first round; after it, growth beyond this fails.
RSS_GROWTH_BOUND_MB = 64.0


class CheckError(Exception):
    """The checks cannot start; ``code`` is stable."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Check:
    number: int
    name: str
    passed: bool | None = None  # None: skipped
    evidence: list[str] = field(default_factory=list)

    def expect(self, condition: bool, what: str) -> None:
        """Record ``what`` as evidence; the check fails if any expectation does not hold."""
        self.evidence.append(("ok: " if condition else "FAILED: ") + what)
        self.passed = condition if self.passed is None else (self.passed and condition)


@dataclass
class Target:
    """What the checks talk to; the operator-side hooks are ``None`` against a deployment."""

    http: httpx.Client
    aliases: list[str]  # at least six approved adapters, the first two also r7/r8 sources
    digests: dict[str, str]
    limited_key: str | None = None  # a key granted only aliases[0]
    count_jobs: Callable[[], int] | None = None
    set_channel: Callable[[str, str], object] | None = None
    channel: str | None = None  # pointing at r7 when the checks start
    r7_r8: tuple[str, str] | None = None
    publish_refusals: Callable[[Check], None] | None = None
    engine_refusal: Callable[[], str] | None = None  # alias of an adapter the engine refuses
    remove_and_reset: Callable[[], str] | None = None  # alias whose artifact is gone
    worker_rss_mb: Callable[[], float | None] | None = None
    reference: Callable[[str, str, int], list[int]] | None = None  # alias, prompt, n -> ids


def _job(http: httpx.Client, adapter: str, sampling: dict[str, Any], timeout_s: float = 300) -> Any:
    accepted = http.post(
        "/v1/jobs", json={"adapter": adapter, "prompt": PROMPT, "sampling": sampling}
    )
    accepted.raise_for_status()
    job_id = accepted.json()["id"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = http.get(f"/v1/jobs/{job_id}", params={"wait_s": 20}).json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
    raise TimeoutError(f"job {job_id} did not finish in {timeout_s} s")


def check_unknown(target: Target) -> Check:
    check = Check(1, "unknown and unauthorised adapters are refused before inference")
    before = target.count_jobs() if target.count_jobs else None
    calls = [("unknown alias", target.http, "no-such-adapter-lorafleet-check")]
    if target.limited_key is None:
        check.evidence.append("not run: an alias the key is not granted (needs a second key)")
    else:
        headers = {"Authorization": f"Bearer {target.limited_key}"}
        limited = httpx.Client(base_url=str(target.http.base_url), headers=headers, timeout=30)
        calls.append(("alias the key is not granted", limited, target.aliases[1]))
    for label, http, name in calls:
        for path, body in (
            ("/v1/completions", {"model": name, "prompt": PROMPT, "max_tokens": 4}),
            ("/v1/jobs", {"adapter": name, "prompt": PROMPT}),
        ):
            response = http.post(path, json=body)
            code = response.json().get("error", {}).get("code")
            check.expect(
                response.status_code == 404 and code == "adapter_not_found",
                f"{label} via {path}: {response.status_code} {code}",
            )
            check.expect(
                "x-lorafleet-job-id" not in response.headers and "choices" not in response.json(),
                f"{label} via {path}: no job id, no text (no base-model fallback)",
            )
    for _, http, _ in calls[1:]:
        http.close()
    if target.count_jobs is None:
        check.evidence.append("not run: counting job records needs the job store (local only)")
    if target.count_jobs is not None and before is not None:
        after = target.count_jobs()
        check.expect(after == before, f"job records in the store: {before} before, {after} after")
    return check


def check_incompatible(target: Target) -> Check:
    check = Check(2, "incompatible adapters refused at publish; the engine's own refusal kept")
    if target.publish_refusals is None or target.engine_refusal is None:
        check.evidence.append("skipped: publishing needs the registry and store (local only)")
        return check
    target.publish_refusals(check)
    alias = target.engine_refusal()
    job = _job(target.http, alias, GREEDY)
    error = job.get("error") or {}
    check.expect(
        job["status"] == "failed" and error.get("code") == "adapter_load_failed",
        f"rank-16 adapter on an engine of max_lora_rank 8: {job['status']} {error.get('code')}",
    )
    check.expect(
        "max_lora_rank" in str(error.get("message")),
        f"the engine's error kept: {str(error.get('message'))[:160]!r}",
    )
    check.expect(job.get("result") is None, "no text was produced")
    return check


def check_reload(target: Target) -> Check:
    check = Check(3, "after more adapters than the working set, the first runs its own revision")
    first = target.aliases[0]
    order = [*target.aliases, first]
    jobs = [_job(target.http, alias, GREEDY) for alias in order]
    last = jobs[-1]
    meta = last.get("metadata") or {}
    check.expect(last["status"] == "succeeded", f"{first} again: {last['status']}")
    digest = target.digests[first]
    check.expect(
        meta.get("revision") == digest
        and meta.get("loaded_digest") == digest
        and meta.get("identity_verified") is True,
        f"worker loaded {str(meta.get('loaded_digest'))[:19]}, expected {digest[:19]}, "
        f"verified {meta.get('identity_verified')}",
    )
    loads = meta.get("load_ms") or {}
    observed = meta.get("residency_before") in ("disk", "remote") and (
        loads.get("engine_load") is not None
    )
    check.expect(
        observed,
        f"loading observed, not inferred: residency before {meta.get('residency_before')}, "
        f"load phases {loads}",
    )
    if target.reference is not None and last.get("result"):
        expected = target.reference(first, PROMPT, GREEDY["max_tokens"])
        check.expect(
            last["result"]["token_ids"] == expected,
            f"tokens {last['result']['token_ids']} equal the transformers + PEFT reference",
        )
    return check


def check_revision_change(target: Target) -> Check:
    check = Check(4, "a channel moves r7 -> r8 mid-stream: the stream ends on r7, new jobs run r8")
    if target.set_channel is None or target.channel is None or target.r7_r8 is None:
        check.evidence.append("skipped: moving a channel needs the registry (local only)")
        return check
    r7, r8 = target.r7_r8
    body = {"model": target.channel, "prompt": PROMPT, "max_tokens": 160}
    body |= {"temperature": 0.0, "ignore_eos": True, "stream": True}
    moved_at: float | None = None
    after_move = 0
    info: dict[str, Any] = {}
    new_job: dict[str, Any] = {}
    with target.http.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line.endswith("[DONE]"):
                continue
            event = json.loads(line[len("data: ") :])
            if any(choice.get("text") for choice in event.get("choices", [])):
                if moved_at is None:
                    target.set_channel(target.channel, r8)
                    moved_at = time.monotonic()
                    new = {"model": target.channel, "prompt": PROMPT, "max_tokens": 4}
                    new_job = target.http.post("/v1/completions", json=new).json()
                else:
                    after_move += 1
            info = event.get("lorafleet", info)
    meta = info.get("metadata") or {}
    check.expect(after_move > 0, f"{after_move} chunks streamed after the channel moved")
    check.expect(
        meta.get("loaded_digest") == target.digests[r7]
        and info.get("revision") == target.digests[r7]
        and meta.get("identity_verified") is True,
        f"stream ran {str(meta.get('loaded_digest'))[:19]} = {r7} ({target.digests[r7][:19]})",
    )
    new_meta = (new_job.get("lorafleet") or {}).get("metadata") or {}
    check.expect(
        new_meta.get("loaded_digest") == target.digests[r8]
        and new_meta.get("identity_verified") is True,
        f"request admitted after the move ran {str(new_meta.get('loaded_digest'))[:19]} = "
        f"{r8} ({target.digests[r8][:19]})",
    )
    return check


def check_missing_artifact(target: Target) -> Check:
    check = Check(5, "after a reset, an adapter whose artifact is gone fails closed")
    if target.remove_and_reset is None:
        check.evidence.append("skipped: removing artifacts and restarting workers is local only")
        return check
    alias = target.remove_and_reset()
    job = _job(target.http, alias, GREEDY)
    error = job.get("error") or {}
    check.expect(
        job["status"] == "failed" and error.get("code") == "adapter_unavailable",
        f"{alias}: {job['status']} {error.get('code')}: {str(error.get('message'))[:120]!r}",
    )
    check.expect(job.get("result") is None, "no text: no silent substitution by the base model")
    return check


async def _cancelled_streams(base_url: str, headers: dict[str, str], adapters: list[str]) -> int:
    """Open one stream per adapter and hang up after its first text; how many produced text."""

    async def one(http: httpx.AsyncClient, alias: str) -> bool:
        body = {"model": alias, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}
        async with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[len("data: ") :])
                if any(choice.get("text") for choice in event.get("choices", [])):
                    return True  # leaving the block closes the connection: the job is cancelled
        return False

    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=120) as http:
        return sum(await asyncio.gather(*(one(http, alias) for alias in adapters)))


def check_cancellation(target: Target) -> Check:
    check = Check(6, "streams cancelled while popularity shifts: bookkeeping drains, memory flat")
    headers = dict(target.http.headers)
    rss: list[float] = []
    for round_ in range(CANCEL_ROUNDS):
        popular = target.aliases[round_ % len(target.aliases)]
        others = [a for a in target.aliases if a != popular]
        adapters = [popular] * (STREAMS_PER_ROUND - 2) + others[:2]
        produced = asyncio.run(_cancelled_streams(str(target.http.base_url), headers, adapters))
        drained = _drained(target.http)
        check.expect(
            drained is True,
            f"round {round_ + 1} (popular {popular}): {produced}/{len(adapters)} streams "
            f"cancelled after their first text; admitted unfinished back to zero: {drained}",
        )
        job = _job(target.http, popular, GREEDY)
        meta = job.get("metadata") or {}
        check.expect(
            job["status"] == "succeeded"
            and meta.get("loaded_digest") == target.digests[popular]
            and meta.get("identity_verified") is True,
            f"round {round_ + 1}: the next request ran {popular}'s revision, verified",
        )
        if target.worker_rss_mb is not None and (value := target.worker_rss_mb()) is not None:
            rss.append(value)
    if len(rss) >= 2:
        growth = rss[-1] - rss[0]
        check.expect(
            growth <= RSS_GROWTH_BOUND_MB,
            f"worker RSS per round (MB): {rss}; growth after round 1 {growth:.1f} MB "
            f"(bound {RSS_GROWTH_BOUND_MB:g})",
        )
    return check


def _drained(http: httpx.Client, timeout_s: float = 60.0) -> bool | None:
    """Admitted-unfinished jobs back to zero (``None``: the key cannot read ``/v1/fleet``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        response = http.get("/v1/fleet")
        if response.status_code != 200:
            return None
        tiers = response.json()["tiers"]
        if sum(t["admitted_unfinished"] for t in tiers) == 0:
            return True
        time.sleep(0.5)
    return False


CHECKS = [
    check_unknown,
    check_incompatible,
    check_reload,
    check_revision_change,
    check_missing_artifact,
    check_cancellation,
]


def run_checks(target: Target) -> list[Check]:
    results = []
    for run in CHECKS:
        try:
            results.append(run(target))
        except Exception as exc:  # a check that cannot run fails with what stopped it
            failed = Check(len(results) + 1, run.__name__.removeprefix("check_"))
            failed.expect(False, f"{type(exc).__name__}: {exc}")
            results.append(failed)
    return results


def table(results: list[Check]) -> Table:
    view = Table(title="acceptance checklist", show_lines=True)
    view.add_column("#")
    view.add_column("check")
    view.add_column("result")
    view.add_column("evidence")
    for check in results:
        verdict = {True: "[green]pass[/]", False: "[red]FAIL[/]", None: "[yellow]skipped[/]"}
        view.add_row(
            str(check.number), check.name, verdict[check.passed], "\n".join(check.evidence)
        )
    return view


def run_remote(gateway_url: str, api_key: str, aliases: list[str]) -> list[Check]:
    """Against a deployment: ``aliases`` are approved adapters the key may use (six or more
    exercise the working set); their digests are what the gateway resolves them to."""
    if len(set(aliases)) != len(aliases):
        raise CheckError("usage", f"--adapter names an adapter twice: {aliases}")
    headers = {"Authorization": f"Bearer {api_key}"}
    try:
        client = httpx.Client(base_url=gateway_url.rstrip("/"), headers=headers, timeout=300)
    except (httpx.InvalidURL, UnicodeError) as exc:
        raise CheckError("gateway_unreachable", f"{gateway_url!r}: {exc}") from exc
    with client as http:
        try:
            listed = http.get("/v1/models")
        except (httpx.HTTPError, UnicodeError) as exc:
            raise CheckError("gateway_unreachable", f"{gateway_url} did not answer: {exc}") from exc
        try:
            roots = {str(m["id"]): str(m["root"]) for m in listed.json()["data"]}
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckError(
                "gateway_refused", f"/v1/models: {listed.status_code} {listed.text[:200]}"
            ) from exc
        missing = [alias for alias in aliases if alias not in roots]
        if missing:
            raise CheckError("adapter_not_found", f"the key is not served {missing}")
        digests = {alias: roots[alias] for alias in aliases}
        return run_checks(Target(http=http, aliases=aliases, digests=digests))


def _tenant(tenants: Any, name: str, operator: bool = False) -> str:
    """A key of tenant ``name``, created if missing (a shared Redis may hold it already)."""
    from lorafleet.registry import RegistryError

    try:
        return str(tenants.create(name, operator=operator)[1])
    except RegistryError:
        return str(tenants.create_key(name)[1])


def run_local(settings: LocalSettings, console: Console) -> list[Check]:
    """Its own stack: fixtures published cold, a worker holding two adapters at most."""
    from contracts.digests import manifest_of
    from contracts.storage import blob_key, manifest_key
    from contracts.tenants import ALL_ADAPTERS
    from lorafleet.experiment.cold_swap import Adapter, ColdSwapModel
    from lorafleet.fixtures import AdapterSpec, write_adapter, write_fixtures
    from lorafleet.publish import Publisher
    from lorafleet.registry import Registry
    from lorafleet.stack import LocalStack
    from lorafleet.tenants import Tenants
    from lorafleet.validation import ADAPTER_FILES, CONFIG_FILE, ValidationFailure

    if settings.stack_file.exists():
        raise CheckError(
            "stack_running",
            f"A local stack is running ({settings.stack_file}); stop it with `lorafleet stack "
            "down` or set LORAFLEET_STATE_DIR to another directory for the checks.",
        )
    specs = write_fixtures(settings.fixtures_dir, 6)
    base = (settings.fixtures_dir / "base").resolve()
    scratch = settings.state_dir.resolve() / "check-adapters"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    with LocalStack(settings, base) as stack:
        console.print("local stack: Redis, S3, gateway, a worker with 2 adapter places")
        stack.start_infra()
        publisher = stack.publisher()
        records: dict[str, AdapterRecord] = {}
        for spec in specs:
            path = settings.fixtures_dir / "adapters" / spec.name
            records[spec.name] = publisher.publish(path, spec.name, Tier.COLD)
        # r7 and r8: two revisions of one workload, behind the channel "extract".
        for alias, spec in (("extract-r7", specs[0]), ("extract-r8", specs[1])):
            records[alias] = publisher.publish(
                settings.fixtures_dir / "adapters" / spec.name, alias, Tier.COLD
            )
        registry = Registry(stack.redis())
        registry.set_channel("extract", "extract-r7")
        tenants = Tenants(stack.redis())
        key, limited = _tenant(tenants, "checker", True), _tenant(tenants, "checker-limited")
        tenants.grant("checker", ALL_ADAPTERS)
        tenants.grant("checker-limited", specs[0].name)
        stack.start_services(CHECK_ENV)
        worker = next(child for child in stack.children if child.name == "worker")
        holder = {"worker": worker}

        def publish_refusals(check: Check) -> None:
            wide = AdapterSpec("check-rank16", 73_000, 16, 32, ("q_proj", "v_proj"))
            write_adapter(scratch / wide.name, wide, base)
            try:
                publisher.publish(scratch / wide.name, wide.name, Tier.COLD)
                check.expect(False, "a rank-16 adapter was published past max_lora_rank 8")
            except ValidationFailure as exc:
                check.expect(exc.code == "rank_too_large", f"rank 16 at publish: {exc.code}")
            foreign = scratch / "check-foreign-base"
            shutil.copytree(settings.fixtures_dir / "adapters" / specs[2].name, foreign)
            config = json.loads((foreign / CONFIG_FILE).read_text())
            config["base_model_name_or_path"] = "another-org/another-base"
            (foreign / CONFIG_FILE).write_text(json.dumps(config))
            try:
                publisher.publish(foreign, "check-foreign-base", Tier.COLD)
                check.expect(False, "an adapter for another base was published")
            except ValidationFailure as exc:
                check.expect(
                    exc.code == "base_model_mismatch", f"another base at publish: {exc.code}"
                )

        def engine_refusal() -> str:
            """Published for a fleet that allows rank 16, run by an engine of rank 8."""
            wider = Publisher(
                base_dir=base,
                base_model_id=str(base),
                limits=dataclasses.replace(stack.settings.limits, max_lora_rank=16),
                registry=registry,
                s3=stack.s3(),
                bucket=stack.settings.s3_bucket,
            )
            wider.publish(scratch / "check-rank16", "check-rank16", Tier.COLD)
            return "check-rank16"

        def remove_and_reset() -> str:
            """An approved adapter whose staged blobs are deleted, then the reset procedure."""
            source = scratch / "check-missing"
            write_adapter(source, AdapterSpec("check-missing", 74_000, 4, 8, ("q_proj",)), base)
            record = publisher.publish(source, "check-missing", Tier.COLD)
            s3 = stack.s3()
            for entry in manifest_of(source, ADAPTER_FILES).files:
                s3.delete_object(Bucket=stack.settings.s3_bucket, Key=blob_key(entry.sha256))
            s3.delete_object(Bucket=stack.settings.s3_bucket, Key=manifest_key(record.digest))
            stack.stop_child(holder["worker"])
            shutil.rmtree(stack.service_env()["LORAFLEET_CACHE_DIR"], ignore_errors=True)
            holder["worker"] = stack.spawn_worker(CHECK_ENV)
            stack.wait_worker(holder["worker"])
            return "check-missing"

        def rss() -> float | None:
            from lorafleet.experiment.run import _rss_mb

            return _rss_mb(holder["worker"].pid)

        oracle: dict[str, ColdSwapModel] = {}

        def reference(alias: str, prompt: str, tokens: int) -> list[int]:
            if "model" not in oracle:
                adapters = {
                    name: Adapter(
                        name, settings.fixtures_dir / "adapters" / name, records[name].digest
                    )
                    for name in (spec.name for spec in specs)
                }
                oracle["model"] = ColdSwapModel(base, adapters)
            model = oracle["model"]
            model.swap(alias)
            return list(model.tokens(prompt, tokens))

        def count_jobs() -> int:
            return sum(1 for _ in stack.redis().scan_iter(match="lorafleet:job:*", count=1000))

        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=stack.gateway_url, headers=headers, timeout=300) as http:
            target = Target(
                http=http,
                aliases=[spec.name for spec in specs],
                digests={alias: record.digest for alias, record in records.items()},
                limited_key=limited,
                count_jobs=count_jobs,
                set_channel=registry.set_channel,
                channel="extract",
                r7_r8=("extract-r7", "extract-r8"),
                publish_refusals=publish_refusals,
                engine_refusal=engine_refusal,
                remove_and_reset=remove_and_reset,
                worker_rss_mb=rss,
                reference=reference,
            )
            console.print("running the six checks")
            return run_checks(target)
