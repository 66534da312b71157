"""Webhook delivery: a CPU-only Celery worker on its own queue (no engine, no torch)."""
