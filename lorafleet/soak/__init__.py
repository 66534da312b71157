"""The soak: the local stack with two real workers under an open-loop mix of every API for a
set duration, while a fault schedule kills and restarts its parts, then checks that nothing
accepted was lost or done twice and that memory came back.

``benchmarks/soak.py`` runs it by hand (30 minutes by default) and prints its tables;
``tests/integration/test_soak.py`` runs three minutes of it and asserts its checks.
"""
