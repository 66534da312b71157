"""Sustained load with faults: two real workers under an open-loop mix of every API (jobs with
and without webhooks, OpenAI completions streamed and not, batches; three tenants, one of them
rate-limited; hot, warm and cold adapters) while a schedule SIGKILLs a worker's process group
(every ``--worker-kill-every-s``, and twice besides), SIGKILLs Redis (restarted on its
append-only file), takes S3 off the network for 10 s, SIGKILLs the gateway and kills one
engine core. A supervisor restarts what exits, as systemd or Kubernetes would.

    .venv/bin/python benchmarks/soak.py [--duration-s 1800 --rate 4 --retention-s 300]
        [--json soak.json]

Then it checks: every accepted request ended exactly once and right (its tokens equal the
transformers + PEFT reference, its revision verified), no job record was left unfinished,
every refusal carried a stable code, every webhook event was delivered once (no call after a
2xx), batch counts add up; once the retention passed, Redis's used_memory and key count are
back near their start and nothing written during the run lacks a TTL. It prints per-minute
latencies, each fault's recovery, and each process's resident-memory slope. The exit code is
1 if anything was violated.

On this machine the client (this process), the gateway, Redis, moto, the webhook worker, two
job workers and their two engine cores share two cores.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from rich.console import Console

from lorafleet.soak.report import print_report
from lorafleet.soak.run import SoakConfig, run_soak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=1800.0)
    parser.add_argument("--rate", type=float, default=4.0, help="requests a second, open loop")
    parser.add_argument("--retention-s", type=int, default=300, help="job/file/event retention")
    parser.add_argument("--worker-kill-every-s", type=float, default=300.0)
    parser.add_argument("--no-faults", action="store_true")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", type=Path, help="write the whole result here")
    parser.add_argument("--keep", type=Path, help="state directory to keep (logs); default temp")
    args = parser.parse_args()
    console = Console(width=160)
    state = args.keep or Path(tempfile.mkdtemp(prefix="lorafleet-soak-"))
    config = SoakConfig(
        state_dir=state,
        duration_s=args.duration_s,
        rate_per_s=args.rate,
        retention_s=args.retention_s,
        faults=not args.no_faults,
        worker_kill_every_s=args.worker_kill_every_s,
        seed=args.seed,
    )
    try:
        result = run_soak(config, say=console.print)
    finally:
        if args.keep is None:
            shutil.rmtree(state, ignore_errors=True)
    print_report(result, console)
    if args.json:
        args.json.write_text(result.to_json())
    sys.exit(1 if result.verdict.violations else 0)


if __name__ == "__main__":
    main()
