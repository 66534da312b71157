"""``lorafleet batch`` and ``lorafleet jobs``: the gateway's batch and job APIs from a shell.

Both use ``lorafleet.client`` against ``--gateway``/``--key``, or the local stack's
``.lorafleet/stack.json`` when those are not given.

Exit codes of ``batch run`` and ``batch watch``: 0 every line succeeded; 2 the batch was refused
(nothing was admitted: the message says why, with its code); 3 it ended with lines that did
not succeed (failed or cancelled: summarised by error code); 4 the gateway could not be
reached or answered with an error (once the batch was admitted, it keeps running and the
command to re-attach is printed); 130 interrupted (likewise).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from contracts.batches import BatchPublic
from contracts.jobs import JobPublic
from lorafleet.client import Client, GatewayError

EXIT_REFUSED = 2
EXIT_LINES_FAILED = 3
EXIT_UNREACHABLE = 4
EXIT_INTERRUPTED = 130

batch_app = typer.Typer(help="Run batches of jobs and collect their results.", no_args_is_help=True)
jobs_app = typer.Typer(help="Submit, inspect and cancel single jobs.", no_args_is_help=True)
console = Console(soft_wrap=True)
errors = Console(stderr=True, soft_wrap=True)

Gateway = Annotated[
    str | None,
    typer.Option(help="Gateway URL (default: the local stack's, .lorafleet/stack.json)."),
]
Key = Annotated[str | None, typer.Option(help="API key (default: the local stack's).")]


def _client(gateway: str | None, key: str | None) -> Client:
    try:
        return Client(gateway, key)
    except ValueError as exc:
        errors.print(f"[red]no gateway[/]: {escape(str(exc))}")
        raise typer.Exit(EXIT_UNREACHABLE) from None


@contextmanager
def _answered() -> Iterator[None]:
    """A call to the gateway: a refusal or an unreachable gateway ends the command (``_failed``),
    and so does a wait that ran out."""
    try:
        yield
    except (GatewayError, httpx.HTTPError) as exc:
        raise _failed(exc) from None
    except TimeoutError as exc:
        errors.print(f"[red]still running[/]: {escape(str(exc))}")
        raise typer.Exit(EXIT_UNREACHABLE) from None


def _failed(exc: GatewayError | httpx.HTTPError) -> typer.Exit:
    """One line on stderr (``code: sentence``) and the exit code for it."""
    if isinstance(exc, GatewayError):
        errors.print(f"[red]{exc.code}[/]: {escape(exc.message)}")
        for detail in (exc.details or [])[:20]:  # the batch's invalid lines, each with why
            where = (
                f"line {detail['line']}"
                if "line" in detail
                else detail.get("field") or detail.get("param") or ""
            )
            errors.print(f"  {escape(str(where))}: {escape(str(detail.get('message', detail)))}")
        return typer.Exit(EXIT_REFUSED if exc.status_code < 500 else EXIT_UNREACHABLE)
    errors.print(f"[red]gateway unreachable[/]: {escape(type(exc).__name__)}: {escape(str(exc))}")
    return typer.Exit(EXIT_UNREACHABLE)


def _shape(path: Path) -> str | None:
    """``None`` for lorafleet's JSONL (job bodies), else the endpoint of OpenAI's batch-file
    shape (``custom_id``, ``method``, ``url``, ``body`` lines), read off the first line."""
    try:
        with path.open(encoding="utf-8") as lines:
            first = next((line for line in lines if line.strip()), "")
        item = json.loads(first)
    except ValueError:  # not UTF-8, not JSON: the gateway says what is wrong, line by line
        return None
    if isinstance(item, dict) and {"method", "url", "body"} <= item.keys():
        return str(item["url"])
    return None


@batch_app.command("run")
def batch_run(
    input_file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, readable=True)],
    out: Annotated[Path, typer.Option("--out", help="Results, one line per input line, in order.")],
    gateway: Gateway = None,
    key: Key = None,
    webhook_url: Annotated[
        str | None, typer.Option(help="POST the batch here when it ends.")
    ] = None,
) -> None:
    """Submit INPUT_FILE as one batch (lorafleet's JSONL or OpenAI's batch-file shape,
    detected), show its progress until it ends, write its results in input order to OUT.

    Exit 0: every line succeeded; 2: refused, nothing admitted; 3: lines failed (summary by
    code); 4: gateway unreachable or failing; 130: interrupted (the batch keeps running)."""
    with _client(gateway, key) as client:
        endpoint = _shape(input_file)
        if endpoint is not None and webhook_url is not None:
            errors.print(
                "[red]webhook_unsupported[/]: --webhook-url applies to lorafleet's JSONL "
                "batches; an OpenAI batch file takes none. Nothing was submitted."
            )
            raise typer.Exit(EXIT_REFUSED)
        try:
            if endpoint is None:
                batch = client.create_batch(input_file, webhook_url=webhook_url)
            else:
                batch = client.create_openai_batch(input_file, endpoint)
        except (GatewayError, httpx.HTTPError) as exc:
            raise _failed(exc) from None
        except KeyboardInterrupt:
            errors.print(
                "interrupted while submitting: no batch id to re-attach to (it may be admitted)"
            )
            raise typer.Exit(EXIT_INTERRUPTED) from None
        _follow(client, batch, out, announce=True)


@batch_app.command("watch")
def batch_watch(
    batch_id: Annotated[str, typer.Argument()],
    out: Annotated[Path, typer.Option("--out", help="Results, one line per input line, in order.")],
    gateway: Gateway = None,
    key: Key = None,
) -> None:
    """Re-attach to a running batch: its progress until it ends, then its results to OUT
    (exit codes as for run)."""
    with _client(gateway, key) as client:
        with _answered():
            batch = client.get_batch(batch_id)
        _follow(client, batch, out)


@batch_app.command("cancel")
def batch_cancel(
    batch_id: Annotated[str, typer.Argument()], gateway: Gateway = None, key: Key = None
) -> None:
    """Cancel every job of the batch that has not started (running ones finish)."""
    with _client(gateway, key) as client, _answered():
        batch = client.cancel_batch(batch_id)
    console.print(f"batch {batch.id}: {batch.status}, {batch.counts.pending} pending")


def _follow(client: Client, batch: BatchPublic, out: Path, announce: bool = False) -> None:
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[counts]}"),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    total = batch.request_counts.total
    try:
        if announce:  # inside: a Ctrl-C right after it still leaves the re-attach command
            console.print(f"batch {batch.id}: {total} jobs admitted")
        with Progress(*columns, console=console, transient=False) as progress:
            task = progress.add_task(batch.id, total=total, counts="", rate="")

            def show(now: BatchPublic) -> None:
                counts = now.counts
                done = total - counts.pending
                elapsed = progress.tasks[0].elapsed or 0.0
                rate = f"{done / elapsed:.1f} jobs/s" if elapsed > 0 else ""
                summary = (
                    f"done {counts.succeeded}  failed {counts.failed + counts.cancelled}  "
                    f"pending {counts.pending}"
                )
                progress.update(task, completed=done, counts=summary, rate=rate)

            ended = client.wait_batch(batch.id, timeout_s=7 * 24 * 3600, progress=show)
        written = _write_results(client, ended.id, out)
    except KeyboardInterrupt:
        errors.print(
            f"interrupted: batch {batch.id} keeps running. Re-attach with\n"
            f"  lorafleet batch watch {batch.id} --out {out}\n"
            f"or cancel it with\n  lorafleet batch cancel {batch.id}"
        )
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except (GatewayError, httpx.HTTPError, TimeoutError) as exc:
        # Admitted already: whatever went wrong now, the batch runs on.
        if isinstance(exc, GatewayError):
            errors.print(f"[red]{exc.code}[/]: {escape(exc.message)}")
        else:
            errors.print(f"[red]gateway unreachable[/]: {escape(type(exc).__name__)}: {exc}")
        errors.print(
            f"batch {batch.id} keeps running. Re-attach with\n"
            f"  lorafleet batch watch {batch.id} --out {out}"
        )
        raise typer.Exit(EXIT_UNREACHABLE) from None
    failures = Counter(
        (line.get("error") or {}).get("code") or line.get("status")
        for line in written
        if line.get("status") != "succeeded"
    )
    console.print(
        f"batch {ended.id} {ended.status}: {ended.counts.succeeded} succeeded, "
        f"{sum(failures.values())} did not; results in {out}"
    )
    if failures:
        table = Table("code", "lines")
        for code, count in failures.most_common():
            table.add_row(str(code), str(count))
        console.print(table)
        raise typer.Exit(EXIT_LINES_FAILED)


def _write_results(client: Client, batch_id: str, out: Path) -> list[dict[str, Any]]:
    """The batch's result lines, in input order, written to ``out`` whole or not at all."""
    lines = list(client.batch_results(batch_id))
    tmp = out.with_name(out.name + ".partial")
    tmp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    tmp.replace(out)
    return lines


@jobs_app.command("submit")
def jobs_submit(
    adapter: Annotated[str, typer.Argument(help="Adapter alias or channel.")],
    prompt: Annotated[str, typer.Argument()],
    max_tokens: Annotated[int, typer.Option(min=1)] = 16,
    temperature: Annotated[float, typer.Option(min=0.0)] = 1.0,
    wait: Annotated[bool, typer.Option("--wait", help="Until it ends; print the result.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    gateway: Gateway = None,
    key: Key = None,
) -> None:
    """Submit one job; prints its id (with --wait, its result and metadata)."""
    sampling = {"max_tokens": max_tokens, "temperature": temperature}
    with _client(gateway, key) as client, _answered():
        accepted = client.create_job(adapter, prompt, sampling=sampling)
        if not wait:
            if as_json:
                console.print_json(accepted.model_dump_json())
            else:
                console.print(accepted.id)
            return
        job = client.wait_job(accepted.id, timeout_s=3600)
    _show_job(job, as_json)


@jobs_app.command("get")
def jobs_get(
    job_id: Annotated[str, typer.Argument()],
    wait: Annotated[bool, typer.Option("--wait", help="Until it ends.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    gateway: Gateway = None,
    key: Key = None,
) -> None:
    """A job's status, result and metadata."""
    with _client(gateway, key) as client, _answered():
        job = client.wait_job(job_id, timeout_s=3600) if wait else client.get_job(job_id)
    _show_job(job, as_json)


@jobs_app.command("cancel")
def jobs_cancel(
    job_id: Annotated[str, typer.Argument()],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    gateway: Gateway = None,
    key: Key = None,
) -> None:
    """Cancel a queued or running job."""
    with _client(gateway, key) as client, _answered():
        job = client.cancel_job(job_id)
    _show_job(job, as_json, judge=False)


def _show_job(job: JobPublic, as_json: bool, judge: bool = True) -> None:
    """The job as a table (or JSON); with ``judge``, exit 3 if it ended without succeeding."""
    if as_json:
        console.print_json(job.model_dump_json())
    else:
        _table(job)
    if judge and job.status.terminal and job.status.value != "succeeded":
        raise typer.Exit(EXIT_LINES_FAILED)


def _table(job: JobPublic) -> None:
    table = Table("field", "value", show_header=False)
    table.add_row("id", job.id)
    table.add_row("status", job.status.value)
    table.add_row("adapter", f"{job.adapter} ({job.revision})")
    if job.result is not None:
        table.add_row("text", escape(job.result.text))
    if job.error is not None:
        table.add_row("error", f"{job.error.code}: {escape(job.error.message)}")
    meta = job.metadata
    if meta is not None:
        table.add_row("identity verified", str(meta.identity_verified))
        table.add_row("residency before", meta.residency_before)
        phases = meta.load_ms.model_dump()
        table.add_row("load ms", ", ".join(f"{k} {v}" for k, v in phases.items() if v is not None))
        table.add_row(
            "queue wait / ttft / e2e ms", f"{meta.queue_wait_ms} / {meta.ttft_ms} / {meta.e2e_ms}"
        )
        table.add_row("worker", f"{meta.worker} (routed {meta.routed})")
    console.print(table)
