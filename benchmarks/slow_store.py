"""A simulated distance to the object store: a TCP proxy in front of an S3 server that holds
back each read request (``GET``) for a fixed delay before passing it on.

The fixture adapters are a few kilobytes and moto answers from this machine's memory, so a
cold adapter is fetched in ~30 ms here. A real rank-16 adapter of a 7B model is ~30-80 MB and
S3 in the same region answers its first byte in tens of milliseconds and streams ~100-200 MB/s
per connection: a fetch of 300-800 ms. Benchmarks that measure what prediction saves
(``prediction.py --store-delay-ms``) put this proxy between the stack and moto so that a fetch
costs what it would; everything else (boto3, the worker's streaming hash, moto's S3 protocol)
is real. Only requests are delayed, not bytes: a model of latency, not of bandwidth.

    .venv/bin/python benchmarks/slow_store.py --upstream 127.0.0.1:9000 --delay-ms 300
        [--port 0]   # prints the port it listens on, then serves until killed
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib

READS = (b"GET ",)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Copy ``reader`` to ``writer``; ``delay_s`` > 0: hold back each chunk that begins a
    read request (boto3 sends a request's head in one write and never pipelines)."""
    try:
        while chunk := await reader.read(65536):
            if delay_s and chunk.startswith(READS):
                await asyncio.sleep(delay_s)
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def serve(upstream: tuple[str, int], port: int, delay_s: float) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*upstream)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(_pipe(client_r, server_w, delay_s), _pipe(server_r, client_w, 0.0))

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="host:port of the S3 server")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--delay-ms", type=float, required=True)
    args = parser.parse_args()
    host, _, port = args.upstream.rpartition(":")
    asyncio.run(serve((host, int(port)), args.port, args.delay_ms / 1000))


if __name__ == "__main__":
    main()
