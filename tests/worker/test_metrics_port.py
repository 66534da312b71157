"""Several worker processes on one host: each gets its own metrics port, probes beside it."""

from __future__ import annotations

import socket

import httpx

from worker import metrics


def _always() -> bool:
    return True


def test_a_taken_port_moves_to_the_next_free_one() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        served = metrics.serve(port, _always, _always)
        assert served != port and port < served < port + metrics.PORT_ATTEMPTS
        metrics.RESIDENT.labels("disk").set(3)
        text = httpx.get(f"http://127.0.0.1:{served}/metrics").text
    assert 'lorafleet_adapters_resident{level="disk"} 3.0' in text


def test_port_zero_takes_any_free_port() -> None:
    served = metrics.serve(0, _always, _always)
    assert served > 0
    assert httpx.get(f"http://127.0.0.1:{served}/metrics").status_code == 200


def test_probes_answer_what_the_worker_says() -> None:
    state = {"ready": True, "live": True}
    served = metrics.serve(0, lambda: state["ready"], lambda: state["live"])
    base = f"http://127.0.0.1:{served}"
    assert httpx.get(f"{base}/readyz").status_code == 200
    assert httpx.get(f"{base}/livez").status_code == 200
    state["ready"] = False  # draining, or its engine failed: no more jobs for it
    assert httpx.get(f"{base}/readyz").status_code == 503
    assert httpx.get(f"{base}/livez").status_code == 200
    state["live"] = False
    assert httpx.get(f"{base}/livez").status_code == 503
    assert httpx.get(f"{base}/metrics").status_code == 200
