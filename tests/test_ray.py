"""Scale-out on Ray Serve with a local Ray instance and 2 replicas of the tiny model: requests reach both, and when
one replica process is killed the other keeps serving while Ray replaces the dead one. Skipped without Ray
(`pip install -e ".[test,ray]"` runs it)."""
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'specdec[ray]')")


def pids_seen(url, n=24, workers=12):
    """Concurrent /health calls (Serve's router spreads concurrent requests) -> the pids that answered."""
    def one(_):
        try:
            return httpx.get(url + "/health", timeout=10).json()["pid"]
        except (httpx.HTTPError, ValueError, KeyError):
            return None
    with ThreadPoolExecutor(workers) as ex:
        return set(ex.map(one, range(n))) - {None}


def test_two_replicas_share_requests_and_survive_a_killed_replica(tiny_dirs):
    import ray
    from specdec.server.ray_serve import build

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build({"target": tiny_dirs["target"], "draft": "ngram", "replicas": 2, "cpus_per_replica": 0.5,
                         "model_name": "tiny"}), name="specdec", route_prefix="/", blocking=False)
        seen, deadline = set(), time.time() + 60
        while len(seen) < 2 and time.time() < deadline:
            seen |= pids_seen(url)
        assert len(seen) == 2, seen  # requests reached both replicas

        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0}
        first = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert first.status_code == 200

        victim = sorted(seen)[0]
        os.kill(victim, signal.SIGKILL)
        time.sleep(1.0)  # the controller notices the death
        after = [httpx.post(url + "/v1/completions", json=body, timeout=30) for _ in range(10)]
        assert [r.status_code for r in after] == [200] * 10  # the other replica keeps serving
        assert all(r.json()["choices"][0]["text"] == first.json()["choices"][0]["text"] for r in after)

        replaced, deadline = set(), time.time() + 90
        while not (replaced - seen) and time.time() < deadline:
            replaced |= pids_seen(url)
            time.sleep(0.5)
        assert replaced - seen and victim not in replaced  # Ray started a new replica in the dead one's place
    finally:
        serve.shutdown()
        ray.shutdown()
