"""The ``lorafleet`` command."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from contracts.errors import ErrorCode
from contracts.queues import Tier
from lorafleet.processes import interrupt_on_signal
from lorafleet.registry import Registry, RegistryError
from lorafleet.settings import LocalSettings
from lorafleet.validation import ValidationFailure

app = typer.Typer(help="lorafleet: serverless multi-LoRA inference.", no_args_is_help=True)
adapters_app = typer.Typer(help="Publish and inspect adapters.", no_args_is_help=True)
channels_app = typer.Typer(help="Point channels at adapter aliases.", no_args_is_help=True)
stack_app = typer.Typer(help="Run the local stack.", no_args_is_help=True)
app.add_typer(adapters_app, name="adapters")
app.add_typer(channels_app, name="channels")
app.add_typer(stack_app, name="stack")
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
    """List registered adapters: alias, tier, state, digest, rank, size."""
    registry = _registry(_settings())
    retired = registry.retired()
    for record in registry.list():
        state = "retired" if record.alias in retired else "active"
        console.print(
            f"{record.alias}\t{record.tier}\t{state}\t{record.digest}\t"
            f"rank {record.rank}\t{record.size_bytes} bytes"
        )


@adapters_app.command("show")
def adapters_show(alias: Annotated[str, typer.Argument()]) -> None:
    """Show one adapter's registry record."""
    registry = _registry(_settings())
    try:
        record = registry.require(alias)
    except RegistryError as exc:
        raise _refused(exc) from exc
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
    console.print(f"retired {record.alias} ({record.digest})")


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


def main() -> None:
    app()
