"""The GPU process: one vLLM engine, adapter residency (S3 -> disk -> CPU -> GPU), tasks."""
