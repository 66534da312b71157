"""A small async client of the gateway's job API (used by the demo, tests and benchmarks)."""

from __future__ import annotations

import time
from typing import Any

import httpx

from contracts.jobs import JobAccepted, JobPublic

LONG_POLL_S = 20.0


def auth_headers(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"}


class GatewayError(Exception):
    def __init__(self, status_code: int, body: dict[str, Any]) -> None:
        error = body.get("error", {})
        super().__init__(f"{status_code} {error.get('code')}: {error.get('message')}")
        self.status_code = status_code
        self.code = error.get("code")
        self.body = body


class JobsClient:
    def __init__(self, http: httpx.AsyncClient) -> None:
        self._http = http

    async def submit(
        self, adapter: str, prompt: str, sampling: dict[str, Any] | None = None
    ) -> JobAccepted:
        body: dict[str, Any] = {"adapter": adapter, "prompt": prompt}
        if sampling is not None:
            body["sampling"] = sampling
        response = await self._http.post("/v1/jobs", json=body)
        if response.status_code != 202:
            raise GatewayError(response.status_code, response.json())
        return JobAccepted.model_validate(response.json())

    async def get(self, job_id: str, wait_s: float = 0.0) -> JobPublic:
        """The job now, or once finished if that happens within ``wait_s`` (long-poll).

        A GET is safe to repeat: one retry covers a pooled connection the server closed
        just as it was reused.
        """
        params = {"wait_s": wait_s}
        try:
            response = await self._http.get(f"/v1/jobs/{job_id}", params=params)
        except httpx.TransportError:
            response = await self._http.get(f"/v1/jobs/{job_id}", params=params)
        if response.status_code != 200:
            raise GatewayError(response.status_code, response.json())
        return JobPublic.model_validate(response.json())

    async def wait(self, job_id: str, timeout_s: float = 300.0) -> JobPublic:
        """Long-poll until the job is terminal; raises ``TimeoutError`` past ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            job = await self.get(job_id, wait_s=max(0.0, min(LONG_POLL_S, remaining)))
            if job.status.terminal:
                return job
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} still {job.status} after {timeout_s} s")

    async def run(
        self,
        adapter: str,
        prompt: str,
        sampling: dict[str, Any] | None = None,
        timeout_s: float = 300.0,
    ) -> JobPublic:
        accepted = await self.submit(adapter, prompt, sampling)
        return await self.wait(accepted.id, timeout_s)
