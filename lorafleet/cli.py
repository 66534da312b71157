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

from contracts.digests import manifest_of
from contracts.queues import Tier
from contracts.registry import BaseModelRef
from lorafleet.processes import interrupt_on_signal
from lorafleet.settings import LocalSettings

app = typer.Typer(help="lorafleet: serverless multi-LoRA inference.", no_args_is_help=True)
adapters_app = typer.Typer(help="Publish and inspect adapters.", no_args_is_help=True)
stack_app = typer.Typer(help="Run the local stack.", no_args_is_help=True)
app.add_typer(adapters_app, name="adapters")
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


def _connections(settings: LocalSettings) -> tuple[str, str | None]:
    """Redis URL and S3 endpoint: the environment's, else the running local stack's."""
    redis_url, endpoint = settings.redis_url, settings.s3_endpoint_url
    if settings.stack_file.exists():
        state = json.loads(settings.stack_file.read_text())
        redis_url = redis_url or state["redis_url"]
        endpoint = endpoint or state["s3_endpoint_url"]
    if not redis_url:
        raise typer.BadParameter("set LORAFLEET_REDIS_URL or start `lorafleet stack up` first")
    return redis_url, endpoint


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


@adapters_app.command("publish")
def adapters_publish(
    directory: Annotated[Path, typer.Argument(exists=True, file_okay=False)],
    alias: Annotated[str, typer.Option(help="Immutable name of this revision.")],
    tier: Annotated[Tier, typer.Option(help="hot, warm or cold.")] = Tier.COLD,
    owner: Annotated[str, typer.Option(help="Owning team or tenant.")] = "default",
) -> None:
    """Upload an adapter to S3 (content-addressed) and register ALIAS for it."""
    from redis import Redis

    from lorafleet.publish import PublishError, publish_adapter
    from lorafleet.stack import s3_client

    settings = _settings()
    redis_url, endpoint = _connections(settings)
    model = _model(settings)
    try:
        record = publish_adapter(
            directory=directory,
            alias=alias,
            tier=tier,
            owner=owner,
            base_model=BaseModelRef(id=str(model), digest=manifest_of(model).digest()),
            redis=Redis.from_url(redis_url, decode_responses=True),
            s3=s3_client(endpoint, settings.s3_region),
            bucket=settings.s3_bucket,
        )
    except PublishError as exc:
        console.print(f"[red]{exc.code}[/]: {exc.message}")
        raise typer.Exit(1) from exc
    console.print_json(record.model_dump_json())


@adapters_app.command("list")
def adapters_list() -> None:
    """List registered adapters."""
    from redis import Redis

    from lorafleet.publish import list_adapters

    redis_url, _ = _connections(_settings())
    for record in list_adapters(Redis.from_url(redis_url, decode_responses=True)):
        console.print(f"{record.alias}\t{record.tier}\t{record.digest}\trank {record.rank}")


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
    stack = LocalStack(settings, _model(settings))
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
    from lorafleet.demo import run_demo

    try:
        code = run_demo(_settings(), jobs, report, console)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: every process the demo started was stopped")
        code = 130
    except (RuntimeError, TimeoutError) as exc:
        console.print(f"[red]demo failed[/]: {exc}")
        console.print("every process the demo started was stopped")
        code = 1
    raise typer.Exit(code)


def main() -> None:
    app()
