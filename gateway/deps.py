"""FastAPI dependencies as ``Annotated`` aliases; the objects live on ``app.state``.

Every dependency is ``async``: FastAPI runs a plain ``def`` one in its thread pool, a thread
hop per dependency per request for what is an attribute read."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from redis.asyncio import Redis

from gateway.batches import Batches
from gateway.config import GatewaySettings
from gateway.files import Files
from gateway.metrics import GatewayMetrics
from gateway.result_store import ResultReader
from gateway.streams import StreamHub
from gateway.submit import Submitter
from gateway.waiter import JobWaiter


async def _settings(request: Request) -> GatewaySettings:
    settings: GatewaySettings = request.app.state.settings
    return settings


async def _redis(request: Request) -> Redis:
    redis: Redis = request.app.state.redis
    return redis


async def _waiter(request: Request) -> JobWaiter:
    waiter: JobWaiter = request.app.state.waiter
    return waiter


async def _streams(request: Request) -> StreamHub:
    streams: StreamHub = request.app.state.streams
    return streams


async def _submitter(request: Request) -> Submitter:
    submitter: Submitter = request.app.state.submitter
    return submitter


async def _batches(request: Request) -> Batches:
    batches: Batches = request.app.state.batches
    return batches


async def _files(request: Request) -> Files:
    files: Files = request.app.state.files
    return files


async def _results(request: Request) -> ResultReader:
    results: ResultReader = request.app.state.results
    return results


async def _metrics(request: Request) -> GatewayMetrics:
    metrics: GatewayMetrics = request.app.state.metrics
    return metrics


SettingsDep = Annotated[GatewaySettings, Depends(_settings)]
RedisDep = Annotated[Redis, Depends(_redis)]
WaiterDep = Annotated[JobWaiter, Depends(_waiter)]
StreamsDep = Annotated[StreamHub, Depends(_streams)]
SubmitterDep = Annotated[Submitter, Depends(_submitter)]
BatchesDep = Annotated[Batches, Depends(_batches)]
FilesDep = Annotated[Files, Depends(_files)]
MetricsDep = Annotated[GatewayMetrics, Depends(_metrics)]
ResultsDep = Annotated[ResultReader, Depends(_results)]
