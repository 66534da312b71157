"""Helpers shared by test modules."""

from __future__ import annotations

import os
from pathlib import Path


def processes_with_env(marker: str) -> list[int]:
    """Pids whose environment contains ``marker`` (the test's unique state dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found
