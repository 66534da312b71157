"""Celery task messages, written directly: protocol 2 in kombu's Redis envelope.

The gateway publishes every job as the message ``Celery.send_task`` would put on the tier's
Redis list (the ``celery`` worker, Flower, KEDA and ``celery inspect`` see nothing
different), but builds it itself: one ``json.dumps`` instead of Celery's producer machinery,
and a string a Lua script can push in the same call that admits the job, so a job is
admitted and enqueued in one step, or neither. ``tests/contracts/test_task_messages.py``
checks the result against what ``send_task`` writes.

Unlike ``send_task``, the message never repeats the job's arguments in its
``argsrepr`` header (which workers log and Flower shows): the prompt travels once, in the
body, and stays out of logs.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import uuid
from typing import Any

_ORIGIN = f"gen{os.getpid()}@{socket.gethostname()}"
_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def task_message(task: str, task_id: str, queue: str, args: list[Any], summary: str) -> str:
    """The JSON a kombu Redis producer ``LPUSH``es onto ``queue`` for ``task(*args)``.

    ``summary`` stands in for the arguments where Celery would print them (``argsrepr``).
    Priority 0 (kombu's plain list, not a priority sub-queue), no ETA, no result expected.
    """
    body = json.dumps([args, {}, _EMBED], separators=(",", ":")).encode()
    envelope = {
        "body": base64.b64encode(body).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {
            "lang": "py",
            "task": task,
            "id": task_id,
            "shadow": None,
            "eta": None,
            "expires": None,
            "group": None,
            "group_index": None,
            "retries": 0,
            "timelimit": [None, None],
            "root_id": task_id,
            "parent_id": None,
            "argsrepr": summary,
            "kwargsrepr": "{}",
            "origin": _ORIGIN,
            "ignore_result": True,
            "replaced_task_nesting": 0,
            "stamped_headers": None,
            "stamps": {},
        },
        "properties": {
            "correlation_id": task_id,
            "reply_to": "",
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": 0,
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
        },
    }
    return json.dumps(envelope, separators=(",", ":"))


def accepted_at(raw: str | bytes) -> float | None:
    """When the job in a job message (as ``task_message`` writes it) was admitted; ``None``
    for a message that is not one."""
    try:
        envelope = json.loads(raw)
        args, _kwargs, _embed = json.loads(base64.b64decode(envelope["body"]))
        return float(args[0]["accepted_at"])
    except (ValueError, KeyError, IndexError, TypeError):
        return None
