"""lorafleet: the CLI and the local stack that wires gateway, worker, Redis and S3 together."""

__version__ = "0.1.0"
