"""The thin HTTP front door: authenticate, resolve, admit, enqueue, report.

Never imports torch, vllm, boto3 or the worker package.
"""
