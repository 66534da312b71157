"""The ``lorafleet`` command."""

from __future__ import annotations

import json
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape

from contracts.errors import ErrorCode
from contracts.queues import Tier, queue_for
from contracts.registry import UnreadableRecord
from lorafleet.cli_jobs import batch_app, jobs_app
from lorafleet.processes import interrupt_on_signal
from lorafleet.registry import Registry, RegistryError
from lorafleet.settings import LocalSettings
from lorafleet.validation import ValidationFailure

if TYPE_CHECKING:
    from lorafleet.experiment.manifest import Manifest
    from lorafleet.experiment.results import Decision
    from lorafleet.tenants import Tenants

app = typer.Typer(help="lorafleet: serverless multi-LoRA inference.", no_args_is_help=True)
adapters_app = typer.Typer(help="Publish and inspect adapters.", no_args_is_help=True)
channels_app = typer.Typer(help="Point channels at adapter aliases.", no_args_is_help=True)
stack_app = typer.Typer(help="Run the local stack.", no_args_is_help=True)
tenants_app = typer.Typer(help="Tenants and their admission limits.", no_args_is_help=True)
keys_app = typer.Typer(help="A tenant's API keys.", no_args_is_help=True)
grants_app = typer.Typer(help="Which adapters a tenant may use.", no_args_is_help=True)
experiment_app = typer.Typer(
    help="The churn experiment: may these adapters share a pool?", no_args_is_help=True
)
app.add_typer(adapters_app, name="adapters")
app.add_typer(channels_app, name="channels")
app.add_typer(stack_app, name="stack")
app.add_typer(tenants_app, name="tenants")
app.add_typer(keys_app, name="keys")
app.add_typer(grants_app, name="grants")
app.add_typer(experiment_app, name="experiment")
app.add_typer(batch_app, name="batch")
app.add_typer(jobs_app, name="jobs")
# Pipes and CI logs get a table wide enough to read; terminals keep their own width.
console = Console(width=None if sys.stdout.isatty() else 160)


def _settings() -> LocalSettings:
    return LocalSettings()


def _model(settings: LocalSettings) -> Path:
    """The base model: ``LORAFLEET_MODEL`` or the fixture model (generated if missing)."""
    if settings.model is not None:
        return settings.model.resolve()
    from lorafleet.fixtures import write_fixtures

    write_fixtures(settings.fixtures_dir)
    return (settings.fixtures_dir / "base").resolve()


def _connections(settings: LocalSettings) -> tuple[str, str | None, bool]:
    """Redis URL, S3 endpoint and whether that endpoint is the local stack's own moto
    (with its fixed credentials): the environment's, else the running local stack's."""
    redis_url, endpoint, local = settings.redis_url, settings.s3_endpoint_url, False
    if settings.stack_file.exists():
        state = json.loads(settings.stack_file.read_text())
        redis_url = redis_url or state["redis_url"]
        if not endpoint:
            endpoint = state["s3_endpoint_url"]
            local = bool(state.get("s3_local_credentials"))
    if not redis_url:
        raise typer.BadParameter("set LORAFLEET_REDIS_URL or start `lorafleet stack up` first")
    return redis_url, endpoint, local


@app.command()
def fixtures(
    out: Annotated[Path, typer.Option(help="Output directory.")],
    adapters: Annotated[int, typer.Option(min=1, help="How many adapters.")] = 12,
) -> None:
    """Write a tiny base model to OUT/base and PEFT adapters to OUT/adapters/<name>."""
    from lorafleet.fixtures import write_fixtures

    for spec in write_fixtures(out, adapters):
        console.print(f"{spec.name}: rank {spec.rank}, targets {','.join(spec.target_modules)}")
    console.print(f"base model: {out / 'base'}")


def _registry(settings: LocalSettings) -> Registry:
    from redis import Redis

    redis_url, _, _ = _connections(settings)
    return Registry(Redis.from_url(redis_url, decode_responses=True))


def _refused(exc: ValidationFailure | RegistryError) -> typer.Exit:
    console.print(f"[red]{exc.code}[/]: {exc.message}")
    return typer.Exit(1)


@adapters_app.command("publish")
def adapters_publish(
    directory: Annotated[Path, typer.Argument(exists=True, file_okay=False)],
    alias: Annotated[str, typer.Option(help="Immutable name of this revision.")],
    tier: Annotated[Tier, typer.Option(help="hot, warm or cold.")] = Tier.COLD,
    owner: Annotated[str, typer.Option(help="Owning team or tenant.")] = "default",
) -> None:
    """Validate an adapter, upload it to S3 (content-addressed) and register ALIAS for it."""
    from lorafleet.publish import Publisher
    from lorafleet.stack import s3_client

    settings = _settings()
    _, endpoint, local = _connections(settings)
    model = _model(settings)
    publisher = Publisher(
        base_dir=model,
        base_model_id=str(model),
        limits=settings.limits,
        registry=_registry(settings),
        s3=s3_client(endpoint, settings.s3_region, local=local),
        bucket=settings.s3_bucket,
    )
    try:
        record = publisher.publish(directory, alias, tier, owner)
    except (ValidationFailure, RegistryError) as exc:
        raise _refused(exc) from exc
    console.print_json(record.model_dump_json())


@adapters_app.command("list")
def adapters_list() -> None:
    """List registered adapters: alias, tier, state, digest, rank, size (or, for a record
    that does not parse, why)."""
    registry = _registry(_settings())
    retired = registry.retired()
    for entry in registry.list():
        state = "retired" if entry.alias in retired else "active"
        if isinstance(entry, UnreadableRecord):
            row = f"{entry.alias}\t-\t{state}\tunreadable: {entry.reason}"
            console.print(row, markup=False, soft_wrap=True)
            continue
        console.print(
            f"{entry.alias}\t{entry.tier}\t{state}\t{entry.digest}\t"
            f"rank {entry.rank}\t{entry.size_bytes} bytes"
        )


@app.command("pools")
def pools() -> None:
    """List the pools (one per base model): pool id, base model id and digest, and the
    queues of its tiers. A pool's metrics carry ``pool="<id>"``: scale its workers on that."""
    for pool, base in _registry(_settings()).pools().items():
        queues = " ".join(queue_for(tier, base.digest) for tier in Tier)
        console.print(f"{pool}\t{base.id}\t{base.digest}\t{queues}", markup=False, soft_wrap=True)


@adapters_app.command("show")
def adapters_show(alias: Annotated[str, typer.Argument()]) -> None:
    """Show one adapter's registry record."""
    registry = _registry(_settings())
    try:
        record = registry.require(alias)
    except RegistryError as exc:
        raise _refused(exc) from exc
    if isinstance(record, UnreadableRecord):
        console.print(f"[red]{ErrorCode.ADAPTER_UNAVAILABLE}[/]: {escape(str(record))}")
        console.print(f"stored: {registry.stored(alias)}", markup=False, soft_wrap=True)
        if alias not in registry.retired():
            console.print(f"retire it with `lorafleet adapters retire {alias}`", markup=False)
        raise typer.Exit(1)
    body = json.loads(record.model_dump_json())
    body["retired"] = alias in registry.retired()
    console.print_json(json.dumps(body))


@adapters_app.command("retire")
def adapters_retire(alias: Annotated[str, typer.Argument()]) -> None:
    """Stop new admissions for ALIAS; jobs already queued still run on it."""
    try:
        record = _registry(_settings()).retire(alias)
    except RegistryError as exc:
        raise _refused(exc) from exc
    what = record.reason if isinstance(record, UnreadableRecord) else record.digest
    console.print(f"retired {record.alias} ({what})", markup=False)


@channels_app.command("set")
def channels_set(
    name: Annotated[str, typer.Argument()], alias: Annotated[str, typer.Argument()]
) -> None:
    """Point channel NAME at ALIAS (new admissions only; queued jobs keep their revision)."""
    try:
        previous = _registry(_settings()).set_channel(name, alias)
    except RegistryError as exc:
        raise _refused(exc) from exc
    console.print(f"{name} -> {alias}" + (f" (was {previous})" if previous else ""))


@channels_app.command("show")
def channels_show(name: Annotated[str | None, typer.Argument()] = None) -> None:
    """Show where channel NAME points, or every channel."""
    registry = _registry(_settings())
    if name is None:
        for channel, alias in registry.channels().items():
            console.print(f"{channel} -> {alias}")
        return
    target = registry.channel(name)
    if target is None:
        console.print(f"[red]{ErrorCode.CHANNEL_NOT_FOUND}[/]: no channel named {name!r}")
        raise typer.Exit(1)
    console.print(f"{name} -> {target}")


def _tenants(settings: LocalSettings) -> Tenants:
    from redis import Redis

    from lorafleet.tenants import Tenants

    redis_url, _, _ = _connections(settings)
    return Tenants(Redis.from_url(redis_url, decode_responses=True))


MaxConcurrent = Annotated[
    int | None, typer.Option(min=1, help="Unfinished jobs at once (default: the gateway's).")
]
RatePerS = Annotated[
    float | None, typer.Option(min=0.001, help="Sustained admissions/s (default: the gateway's).")
]
Burst = Annotated[
    int | None, typer.Option(min=1, help="Admissions at once (default: the gateway's).")
]


def _show_key(key: str) -> None:
    console.print(key, soft_wrap=True, highlight=False)
    console.print("[yellow]store it now: this key is never shown again[/]", highlight=False)


@tenants_app.command("create")
def tenants_create(
    name: Annotated[str, typer.Argument()],
    max_concurrent: MaxConcurrent = None,
    rate_per_s: RatePerS = None,
    burst: Burst = None,
    operator: Annotated[
        bool, typer.Option(help="May read fleet-wide state (GET /v1/fleet).")
    ] = False,
) -> None:
    """Create tenant NAME and print its first API key (shown once; only a hash is kept)."""
    from contracts.tenants import TenantLimits

    limits = TenantLimits(max_concurrent=max_concurrent, rate_per_s=rate_per_s, burst=burst)
    try:
        _, key = _tenants(_settings()).create(name, limits, operator)
    except RegistryError as exc:
        raise _refused(exc) from exc
    _show_key(key)


@tenants_app.command("list")
def tenants_list() -> None:
    """Every tenant with its own limits (blank: the gateway's default)."""
    for record in _tenants(_settings()).all():
        limits = record.limits
        console.print(
            f"{record.name}\tmax_concurrent {limits.max_concurrent or '-'}\t"
            f"rate_per_s {limits.rate_per_s or '-'}\tburst {limits.burst or '-'}",
            highlight=False,
        )


@tenants_app.command("limits")
def tenants_limits(
    name: Annotated[str, typer.Argument()],
    max_concurrent: MaxConcurrent = None,
    rate_per_s: RatePerS = None,
    burst: Burst = None,
) -> None:
    """Replace NAME's limits (options left out go back to the gateway's defaults)."""
    from contracts.tenants import TenantLimits

    limits = TenantLimits(max_concurrent=max_concurrent, rate_per_s=rate_per_s, burst=burst)
    try:
        record = _tenants(_settings()).set_limits(name, limits)
    except RegistryError as exc:
        raise _refused(exc) from exc
    console.print_json(record.limits.model_dump_json())


@tenants_app.command("webhook-secret")
def tenants_webhook_secret(
    name: Annotated[str, typer.Argument()],
    rotate: Annotated[bool, typer.Option(help="Start signing with a new secret.")] = False,
    grace_s: Annotated[
        float, typer.Option(min=0, help="With --rotate: how long the old secret still signs.")
    ] = 24 * 3600,
) -> None:
    """Show NAME's webhook signing secret (newest first), or rotate it."""
    from datetime import UTC, datetime

    try:
        secrets = _tenants(_settings()).webhook_secrets(name, rotate, grace_s)
    except RegistryError as exc:
        raise _refused(exc) from exc
    for secret in secrets.secrets:
        until = secret.expires_at
        ends = datetime.fromtimestamp(until, tz=UTC).isoformat() if until else "current"
        console.print(f"{secret.secret}\t{ends}", soft_wrap=True, highlight=False)


@keys_app.command("create")
def keys_create(tenant: Annotated[str, typer.Argument()]) -> None:
    """Issue another API key for TENANT (shown once)."""
    try:
        _, key = _tenants(_settings()).create_key(tenant)
    except RegistryError as exc:
        raise _refused(exc) from exc
    _show_key(key)


@keys_app.command("list")
def keys_list(tenant: Annotated[str, typer.Argument()]) -> None:
    """TENANT's live keys: id, public prefix, created, expiry (rotated keys in their grace)."""
    try:
        keys = _tenants(_settings()).keys(tenant)
    except RegistryError as exc:
        raise _refused(exc) from exc
    for key in keys:
        expires = key.expires_at.isoformat() if key.expires_at else "-"
        console.print(
            f"{key.key_id}\t{key.prefix}\tcreated {key.created_at.isoformat()}\texpires {expires}",
            highlight=False,
        )


@keys_app.command("revoke")
def keys_revoke(
    tenant: Annotated[str, typer.Argument()], key_id: Annotated[str, typer.Argument()]
) -> None:
    """Revoke TENANT's key KEY_ID: refused from the gateway's next request on."""
    try:
        _tenants(_settings()).revoke(tenant, key_id)
    except RegistryError as exc:
        raise _refused(exc) from exc
    console.print(f"revoked {key_id}")


@keys_app.command("rotate")
def keys_rotate(
    tenant: Annotated[str, typer.Argument()],
    key_id: Annotated[str, typer.Argument()],
    grace_s: Annotated[
        int, typer.Option(min=0, help="Seconds the old key keeps working (0: ends now).")
    ] = 0,
) -> None:
    """Issue a new key for TENANT replacing KEY_ID (shown once)."""
    try:
        _, key = _tenants(_settings()).rotate(tenant, key_id, grace_s)
    except RegistryError as exc:
        raise _refused(exc) from exc
    _show_key(key)


@grants_app.command("add")
def grants_add(
    tenant: Annotated[str, typer.Argument()],
    name: Annotated[str, typer.Argument(help="An alias, a channel, or '*' for every adapter.")],
) -> None:
    """Let TENANT use adapter alias or channel NAME."""
    try:
        _tenants(_settings()).grant(tenant, name)
    except RegistryError as exc:
        raise _refused(exc) from exc
    console.print(f"{tenant} may use {name}")


@grants_app.command("remove")
def grants_remove(
    tenant: Annotated[str, typer.Argument()], name: Annotated[str, typer.Argument()]
) -> None:
    """Stop TENANT using NAME for new jobs (admitted jobs still run)."""
    try:
        removed = _tenants(_settings()).revoke_grant(tenant, name)
    except RegistryError as exc:
        raise _refused(exc) from exc
    console.print(f"{tenant} may no longer use {name}" if removed else f"{tenant} had no {name}")


@grants_app.command("list")
def grants_list(tenant: Annotated[str, typer.Argument()]) -> None:
    """The names TENANT is granted."""
    try:
        grants = _tenants(_settings()).grants(tenant)
    except RegistryError as exc:
        raise _refused(exc) from exc
    for name in grants:
        console.print(name, highlight=False)


@stack_app.command("up")
def stack_up(
    detach: Annotated[
        bool, typer.Option(help="Return once ready; stop with `stack down`.")
    ] = False,
) -> None:
    """Start Redis, S3, the gateway and one worker; writes .lorafleet/stack.json."""
    from lorafleet.stack import LocalStack

    settings = _settings()
    if settings.stack_file.exists():
        console.print(
            f"[red]a stack is already recorded in {settings.stack_file}[/]; "
            "run `lorafleet stack down` first"
        )
        raise typer.Exit(1)
    stack = LocalStack(settings, _model(settings), detached=detach)
    try:
        stack.start_infra()
        stack.start_services()
    except BaseException:
        stack.stop()
        raise
    console.print_json(json.dumps(stack.state()))
    if detach:
        return
    console.print("stack running; Ctrl-C stops it")
    signal.signal(signal.SIGTERM, interrupt_on_signal)
    try:
        while all(child.alive() for child in stack.children):
            time.sleep(0.5)
        console.print("[red]a service exited[/]; stopping the stack")
    except KeyboardInterrupt:
        pass
    finally:
        stack.stop()


@stack_app.command("down")
def stack_down() -> None:
    """Stop exactly the processes a detached `stack up` started."""
    from lorafleet.stack import stop_recorded

    stopped = stop_recorded(_settings().stack_file)
    console.print(f"stopped: {', '.join(stopped) or 'nothing'}")


@app.command()
def demo(
    jobs: Annotated[int, typer.Option(min=1, help="How many jobs to submit.")] = 200,
    report: Annotated[Path, typer.Option(help="Where to write the JSON report.")] = Path(
        "demo-report.json"
    ),
) -> None:
    """Fixtures, local stack, 12 adapters (2 hot, 4 warm, 6 cold), skewed jobs, a report."""
    import httpx

    from lorafleet.client import GatewayError
    from lorafleet.demo import run_demo

    try:
        code = run_demo(_settings(), jobs, report, console)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: every process the demo started was stopped")
        code = 130
    except (ValidationFailure, RegistryError) as exc:
        console.print(f"[red]demo failed[/]: {exc.code}: {exc.message}")
        console.print("every process the demo started was stopped")
        code = 1
    except (RuntimeError, TimeoutError, httpx.HTTPError, GatewayError) as exc:
        console.print(f"[red]demo failed[/]: {type(exc).__name__}: {exc}")
        console.print("every process the demo started was stopped")
        code = 1
    raise typer.Exit(code)


@experiment_app.command("template")
def experiment_template(
    local: Annotated[
        bool,
        typer.Option(
            "--local",
            help="Fill what this machine and the local fixtures tell (environment, base model, "
            "registry, corpus) and small workload values for them, instead of REQUIRED.",
        ),
    ] = False,
    adapters: Annotated[int, typer.Option(min=1, help="--local: how many fixture adapters.")] = 6,
    requests: Annotated[int, typer.Option(min=1, help="--local: requests per trial.")] = 200,
    rate: Annotated[float, typer.Option(min=0.01, help="--local: offered rate, req/s.")] = 4.0,
) -> None:
    """Print a manifest with every field; REQUIRED where a value must be recorded."""
    from lorafleet.experiment.manifest import local_template, template
    from lorafleet.fixtures import write_fixtures

    if not local:
        sys.stdout.write(template())
        return
    settings = _settings()
    specs = write_fixtures(settings.fixtures_dir, adapters)
    base = (settings.fixtures_dir / "base").resolve()  # the model the fixtures were made for
    chosen = [(settings.fixtures_dir / "adapters" / spec.name, "cold") for spec in specs]
    sys.stdout.write(local_template(base, chosen, requests, rate))


errors = Console(stderr=True, soft_wrap=True)


def _experiment_failed(code: str, message: str) -> typer.Exit:
    """A refusal on stderr, one unwrapped line: ``code: sentence``; exit status 2."""
    errors.print(f"[red]{code}[/]: {escape(message)}")
    return typer.Exit(2)


@experiment_app.command("digest")
def experiment_digest(
    directory: Annotated[Path, typer.Argument(exists=True, file_okay=False)],
    tokenizer: Annotated[
        bool, typer.Option("--tokenizer", help="The digest of its tokenizer and chat template.")
    ] = False,
    adapter: Annotated[
        bool, typer.Option("--adapter", help="An adapter's digest (its config and weights).")
    ] = False,
) -> None:
    """Print the content digest the manifest records for DIRECTORY (a base model by default)."""
    from contracts.digests import manifest_of
    from lorafleet.experiment.manifest import tokenizer_digest
    from lorafleet.validation import ADAPTER_FILES

    if tokenizer:
        print(tokenizer_digest(directory))
    elif adapter:
        print(manifest_of(directory, ADAPTER_FILES).digest())
    else:
        print(manifest_of(directory).digest())


@experiment_app.command("run")
def experiment_run(
    manifest_path: Annotated[Path, typer.Argument(metavar="MANIFEST")],
    out: Annotated[Path, typer.Option(help="Directory for results.json, requests.jsonl, report.")],
    gateway: Annotated[
        str | None, typer.Option(help="A deployment's gateway; default: the local stack.")
    ] = None,
    key: Annotated[str | None, typer.Option(help="API key for --gateway.")] = None,
) -> None:
    """Run every cell of MANIFEST; write results, the request sequence and the report.
    Exit 0: a decision; 1: identity mismatches (stop the rollout); 2: the run could not be
    made (nothing is written when that is known before it starts); 3: no decision (nothing
    started, or not enough evidence)."""
    import httpx

    from lorafleet.experiment.analysis import INSUFFICIENT, NOTHING_RAN, STOP
    from lorafleet.experiment.manifest import ManifestError, load
    from lorafleet.experiment.report import write_report
    from lorafleet.experiment.run import (
        engine_help,
        preflight_local,
        preflight_remote,
        run_local,
        run_remote,
        write_results,
    )

    signal.signal(signal.SIGTERM, interrupt_on_signal)
    if (gateway is None) != (key is None):
        raise _experiment_failed("usage", "--gateway and --key go together.")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise _experiment_failed("out_not_empty", f"{out} is not an empty directory.")
    try:
        manifest = load(manifest_path)
        if gateway is not None and key is not None:
            preflight_remote(gateway, key, manifest)
        else:
            preflight_local(manifest, _settings())
    except ManifestError as exc:
        raise _experiment_failed(exc.code, exc.message) from exc
    console.print(f"planned: {_estimate(manifest, gateway is None)}")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.yaml").write_text(manifest_path.read_text())
    try:
        if gateway is not None and key is not None:
            (out / "engine-help.txt").write_text(
                "Not recorded: the engine runs in the deployment, not here; the manifest's "
                "runtime section records it.\n"
            )
            results = run_remote(manifest, out, gateway, key, console)
        else:
            console.print("recording the engine's own `serve --help`")
            engine_help(out)
            results = run_local(manifest, out, _settings(), console)
    except ManifestError as exc:
        sent = out / "requests.jsonl"
        if not sent.exists() or sent.stat().st_size == 0:  # refused before anything ran
            if created:
                shutil.rmtree(out, ignore_errors=True)
            else:
                for name in ("manifest.yaml", "engine-help.txt", "requests.jsonl"):
                    (out / name).unlink(missing_ok=True)
        raise _experiment_failed(exc.code, exc.message) from exc
    except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:
        sent = out / "requests.jsonl"
        if sent.exists() and sent.stat().st_size:
            errors.print(f"requests of the trials that ended are in {sent}")
        raise _experiment_failed("run_failed", f"{type(exc).__name__}: {exc}") from exc
    except KeyboardInterrupt:
        console.print(
            "[yellow]interrupted[/]: requests of the trials that ended are in "
            "requests.jsonl; every process the run started was stopped"
        )
        raise typer.Exit(130) from None
    write_results(out, results)
    report = write_report(out)
    console.print(_decision_text(results.decision))
    console.print(f"results: {out / 'results.json'}  report: {report}")
    verdict = results.decision.verdict
    raise typer.Exit(1 if verdict == STOP else 3 if verdict in (NOTHING_RAN, INSUFFICIENT) else 0)


def _estimate(manifest: Manifest, local: bool) -> str:
    """Trials, requests and the time the arrivals alone take (restarts come on top)."""
    m = manifest
    cells = len(m.cells()) if local else 1
    kinds = len(m.trials) if local else 1
    per_rate = {rate: m.requests_per_cell / rate for rate in m.offered_rates}
    trials = cells * kinds * len(m.traffic_profiles) * m.repetitions
    seconds = trials * sum(per_rate.values())
    if local and m.cold_swap_baseline:
        seconds += len(m.cold_swap_baseline) * m.repetitions * sum(per_rate.values())
    requests = trials * len(m.offered_rates) * m.requests_per_cell
    restarts = cells * (1 + len(m.offered_rates) * len(m.traffic_profiles) * m.repetitions)
    return (
        f"{cells} cell(s), {trials * len(m.offered_rates)} trials, {requests} requests; "
        f"arrivals alone take {seconds / 60:.0f} min"
        + (f", plus up to {restarts} worker starts" if local and "reset" in m.trials else "")
    )


def _decision_text(decision: Decision) -> str:
    lines = [f"[bold]decision: {escape(decision.verdict)}[/]"]
    lines += [f"  because: {escape(reason)}" for reason in decision.because]
    if decision.isolate:
        lines.append(f"  isolate: {', '.join(decision.isolate)}")
    if decision.admission_limits:
        limits = ", ".join(f"{k}: {v:g} req/s" for k, v in decision.admission_limits.items())
        lines.append(f"  admission limits measured: {limits}")
    return "\n".join(lines)


@experiment_app.command("check")
def experiment_check(
    gateway: Annotated[
        str | None, typer.Option(help="A deployment's gateway; default: a local stack of its own.")
    ] = None,
    key: Annotated[str | None, typer.Option(help="API key for --gateway.")] = None,
    adapter: Annotated[
        list[str] | None,
        typer.Option(
            help="--gateway: an approved adapter the key may use (at least three; more than "
            "the workers hold exercises eviction and reload)."
        ),
    ] = None,
) -> None:
    """Run the routing and cold-load acceptance checklist; print pass/fail with evidence.
    Exit 0: every check that ran passed; 1: a check failed; 2: the checks could not start."""
    from lorafleet.experiment import check

    signal.signal(signal.SIGTERM, interrupt_on_signal)
    if (gateway is None) != (key is None):
        raise _experiment_failed("usage", "--gateway and --key go together.")
    if adapter and gateway is None:
        raise _experiment_failed(
            "usage", "--adapter goes with --gateway (a local run has its own)."
        )
    try:
        if gateway is not None and key is not None:
            if not adapter or len(adapter) < 3:
                raise _experiment_failed("usage", "--gateway needs --adapter at least three times.")
            results = check.run_remote(gateway, key, adapter)
        else:
            results = check.run_local(_settings(), console)
    except check.CheckError as exc:
        raise _experiment_failed(exc.code, exc.message) from exc
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: every process the check started was stopped")
        raise typer.Exit(130) from None
    console.print(check.table(results))
    failed = [c.number for c in results if c.passed is False]
    console.print(f"failed: {failed}" if failed else "every check that ran passed")
    raise typer.Exit(1 if failed else 0)


@experiment_app.command("report")
def experiment_report(
    out: Annotated[Path, typer.Argument(exists=True, file_okay=False, metavar="DIR")],
) -> None:
    """Rebuild DIR/report.html from DIR/results.json and DIR/requests.jsonl."""
    from pydantic import ValidationError

    from lorafleet.experiment.report import load, write_report

    try:
        results, _ = load(out)
    except (OSError, ValueError, ValidationError) as exc:
        raise _experiment_failed(
            "results_unreadable", f"{out} holds no readable results.json and requests.jsonl: {exc}"
        ) from exc
    path = write_report(out)
    console.print(_decision_text(results.decision))
    console.print(f"report: {path}")


def main() -> None:
    app()
