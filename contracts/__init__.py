"""The wire contract shared by the gateway, the worker and the CLI.

Standard library and pydantic only: this package never imports ``gateway`` or ``worker``.
"""
