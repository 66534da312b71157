"""The engine-step trace (``lorafleet.step_trace``): loaded by vLLM's own plugin loader, off
unless asked for, one line per step that scheduled work, and the summary benchmarks print.

The patching runs in a subprocess: it changes vLLM's scheduler class for the process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lorafleet.step_trace import ENV, Step, read, shape

# vLLM's own loader, as an engine core runs it at start; then a scheduler step whose
# original is replaced by a stand-in (no engine here), called the way the engine calls it.
PROBE = """
import dataclasses, json, sys
from types import SimpleNamespace as NS
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler

# The stand-ins below carry the fields the trace reads: vLLM's own must have them.
fields = {f.name for f in dataclasses.fields(SchedulerOutput)}
assert {"num_scheduled_tokens", "total_num_scheduled_tokens", "scheduled_new_reqs"} <= fields

outputs = [
    NS(num_scheduled_tokens={"a": 64, "b": 1}, total_num_scheduled_tokens=65,
       scheduled_new_reqs=["a"]),
    NS(num_scheduled_tokens={}, total_num_scheduled_tokens=0, scheduled_new_reqs=[]),
    NS(num_scheduled_tokens={"c": 3}, total_num_scheduled_tokens=3, scheduled_new_reqs=[]),
    NS(num_scheduled_tokens={"c": 1}, total_num_scheduled_tokens=1, scheduled_new_reqs=[]),
]
Scheduler.schedule = lambda self, *args, **kwargs: outputs.pop(0)
from vllm.plugins import load_general_plugins
load_general_plugins()
traced = getattr(Scheduler.schedule, "_lorafleet_traced", False)
from lorafleet import step_trace
step_trace.install()  # again, as a second load would: still one line a step
me = NS(
    running=[NS(lora_request=NS(lora_int_id=1)), NS(lora_request=NS(lora_int_id=1)),
             NS(lora_request=NS(lora_int_id=2)), NS(lora_request=None)],
    waiting=[1, 2],
    kv_holding_waiting=[3],
)
import os
# The steps run in a process forked after the patch, as an engine core forked from vLLM's
# front end does. The third step's scheduler lacks what the trace reads: its step is still
# given, and the trace stops (the fourth writes nothing).
child = os.fork()
if child == 0:
    given = [Scheduler.schedule(me), Scheduler.schedule(me)]
    given.append(Scheduler.schedule(NS(waiting=[])))
    given.append(Scheduler.schedule(me))
    with open(f"given-{os.getpid()}.json", "w") as out:
        json.dump([g.total_num_scheduled_tokens for g in given], out)
    os._exit(0)
os.waitpid(child, 0)
print(child)
print(json.dumps({"traced": traced, "given": json.load(open(f"given-{child}.json"))}))
"""


def _probe(tmp_path: Path, trace: str | None) -> tuple[str, int]:
    """What the probe printed last, and the pid of the process that ran its steps."""
    env = {k: v for k, v in os.environ.items() if k not in (ENV, "VLLM_PLUGINS")}
    if trace is not None:
        env[ENV] = trace
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    *_, pid, printed = done.stdout.strip().splitlines()
    return printed, int(pid)


def test_vllms_plugin_loader_installs_the_trace_only_when_asked(tmp_path: Path) -> None:
    assert _probe(tmp_path, None)[0] == '{"traced": false, "given": [65, 0, 3, 1]}'
    # A directory it cannot make leaves the scheduler as it was (and the engine starting).
    occupied = tmp_path / "a-file"
    occupied.write_text("")
    assert _probe(tmp_path, str(occupied))[0] == '{"traced": false, "given": [65, 0, 3, 1]}'

    trace = tmp_path / "trace"
    printed, pid = _probe(tmp_path, str(trace))
    assert printed == '{"traced": true, "given": [65, 0, 3, 1]}'
    (written,) = trace.iterdir()
    assert written.name == f"steps-{pid}.tsv"  # the forked process that ran the steps
    # The step that scheduled nothing wrote nothing; the one that did, what it saw.
    (step,) = read(trace, 0, float("inf"))
    assert (step.running, step.waiting, step.scheduled, step.tokens, step.new) == (4, 3, 2, 65, 1)
    assert step.adapters == 2  # ids 1 and 2; the base model's request is none


def test_read_keeps_the_window_in_time_order_and_leaves_a_partial_line(tmp_path: Path) -> None:
    def at(t: float, running: int = 1) -> str:
        return Step(t, running, 0, running, running, 0, 1).line()

    (tmp_path / "steps-1.tsv").write_text(at(3.0) + at(1.0) + at(9.0))
    (tmp_path / "steps-2.tsv").write_text(at(2.0) + at(4.0)[:-1])  # still being written
    (tmp_path / "other.tsv").write_text("not a trace\n")
    assert [step.at for step in read(tmp_path, 1.0, 4.0)] == [1.0, 2.0, 3.0]


def test_shape_counts_thin_steps_and_times_from_the_runs_start() -> None:
    running = [1, 2, 2, 30, 64, 64, 64, 8, 8, 4]
    steps = [Step(10 + i * 0.01, r, 0, r, r, 0, 1) for i, r in enumerate(running)]
    found = shape(steps, started=9.5)
    assert found is not None
    assert found.steps == 10
    assert found.mean_batch == sum(running) / 10
    assert found.median_batch == (8 + 8) / 2
    assert found.thin_steps == 6  # at most 64 / 8 = 8 requests: 1, 2, 2, 8, 8, 4
    assert round(found.first_step_ms) == 500
    assert round(found.to_half_ms) == 540  # 64 / 2 = 32 first reached by the fifth step

    # Middles that differ: the odd run takes the middle one, the even one their mean.
    def batches(*running: int) -> list[Step]:
        return [Step(i, r, 0, r, r, 0, 1) for i, r in enumerate(running)]

    odd, even = shape(batches(7, 1, 5, 3, 64), 0), shape(batches(7, 1, 5, 3), 0)
    assert odd is not None and odd.median_batch == 5
    assert even is not None and even.median_batch == 4
    assert shape([], started=0) is None
