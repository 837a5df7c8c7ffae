"""Data-parallel serving: two ``tideserve serve`` replicas behind vllm-router, all real processes on loopback.

Checks what docs/deployment.md promises: every request through the router completes (completions and
chat, streamed or not, through the openai SDK); ``cache_aware`` keeps requests that share a long prefix
on one replica, whose prefix-cache hit counter rises while the other's does not; and when a replica is
killed mid-run, only the requests running on it fail, later ones succeed, and once the router has marked
it unhealthy it sends it nothing more. The killing test comes last: it leaves one replica dead.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tideserve.bench.launch import ServerProcess, free_port

pytest.importorskip("vllm_router", reason="vllm-router is in the test extra: pip install -e '.[test]'")
openai = pytest.importorskip("openai")

REPLICA_FLAGS = ["--dtype", "float32", "--max-model-len", "512", "--block-size", "16", "--shutdown-timeout", "5"]
LOAD_TIMEOUT = 180.0
TIMEOUT = 60.0
COMPLETIONS = ("/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def replicas(smollm2_gguf_path) -> Iterator[list[ServerProcess]]:
    """Two replicas, loaded in parallel, one intra-op thread each (the machine has two cores)."""
    servers = []
    for i in range(2):
        port = free_port()
        cmd = [sys.executable, "-m", "tideserve.cli", "serve", "--port", str(port), *REPLICA_FLAGS]
        servers.append(ServerProcess(cmd, port, env={"OMP_NUM_THREADS": "1"}, ready_path="/health/ready",
                                     ready_timeout_s=LOAD_TIMEOUT, name=f"replica{i}"))
    try:
        with ThreadPoolExecutor(len(servers)) as pool:
            for started in [pool.submit(s.__enter__) for s in servers]:
                started.result()
        yield servers
    finally:
        for s in servers:
            s.stop()


class Router:
    def __init__(self, proc: ServerProcess, metrics_port: int) -> None:
        self.proc = proc
        self.url = proc.base_url
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="EMPTY", max_retries=0, timeout=TIMEOUT)

    def metric(self, name: str, worker: str) -> float:
        return scrape(self.metrics_url, name, worker=worker)


@pytest.fixture
def start_router(replicas) -> Callable[..., object]:
    """``with start_router("cache_aware") as router:`` runs vllm-router in front of both replicas."""

    @contextmanager
    def start(policy: str) -> Iterator[Router]:
        port, metrics_port = free_port(), free_port()
        cmd = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", *(r.base_url for r in replicas), "--policy", policy,
               "--health-check-interval-secs", "1", "--worker-startup-check-interval", "1",
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
        with ServerProcess(cmd, port, ready_path="/readiness", ready_timeout_s=60, name=f"router-{policy}") as p:
            yield Router(p, metrics_port)

    return start


def scrape(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    text = httpx.get(url, timeout=10, trust_env=False).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def api_requests(replica: ServerProcess) -> float:
    url = replica.base_url + "/metrics"
    return sum(scrape(url, "http_requests_total", handler=h) for h in COMPLETIONS)


def prefix_hits(replica: ServerProcess) -> float:
    return scrape(replica.base_url + "/metrics", "vllm:prefix_cache_hits_total")


def complete(client: openai.OpenAI, prompt: str, max_tokens: int = 4) -> str:
    out = client.completions.create(model="", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == max_tokens
    return out.choices[0].text


def test_every_request_through_the_router_completes(replicas, start_router):
    before = [api_requests(r) for r in replicas]
    with start_router("round_robin") as router, router.client() as client:
        model = client.models.list().data[0].id

        def chat(stream: bool) -> str:
            messages = [{"role": "user", "content": "Name a color."}]
            if not stream:
                out = client.chat.completions.create(model=model, messages=messages, max_tokens=4)
                assert out.choices[0].finish_reason in ("stop", "length")
                return out.choices[0].message.content
            chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                                         stream=True))
            assert chunks[-1].choices[0].finish_reason in ("stop", "length")
            return "".join(c.choices[0].delta.content or "" for c in chunks)

        def stream_completion(prompt: str) -> str:
            chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=4, stream=True,
                                                    extra_body={"ignore_eos": True}))
            assert chunks[-1].choices[0].finish_reason == "length"
            return "".join(c.choices[0].text for c in chunks)

        jobs = [lambda: complete(client, "The capital of France is"), lambda: complete(client, "One, two,"),
                lambda: stream_completion("Water boils at"), lambda: stream_completion("The sky is"),
                lambda: chat(False), lambda: chat(False), lambda: chat(True), lambda: chat(True)]
        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(lambda job: job(), jobs))
    assert all(isinstance(t, str) for t in texts) and len(texts) == 8
    served = [api_requests(r) - b for r, b in zip(replicas, before)]
    assert served == [4, 4], served  # round robin: each replica served half


def test_cache_aware_keeps_a_shared_prefix_on_one_replica(replicas, start_router):
    shared = ("You are a meticulous assistant for a shipping company. Always answer with the tracking "
              "status first, then the expected delivery date, then any customs notes, and never invent "
              "parcel numbers. Be brief, polite and precise; when unsure, say so and suggest contacting "
              "the depot. Question: ")
    hits_before = [prefix_hits(r) for r in replicas]
    requests_before = [api_requests(r) for r in replicas]
    with start_router("cache_aware") as router, router.client() as client:
        for question in ("where is parcel A?", "where is parcel B?", "is parcel C late?",
                         "when does parcel D arrive?", "why is parcel E held?"):
            complete(client, shared + question, max_tokens=2)
    served = [api_requests(r) - b for r, b in zip(replicas, requests_before)]
    hits = [prefix_hits(r) - b for r, b in zip(replicas, hits_before)]
    winner = served.index(5)  # all five on one replica
    assert served[1 - winner] == 0, served
    # The four after the first reuse the shared prefix's full blocks (the prefix is 60+ tokens: 3+ blocks).
    assert hits[winner] >= 4 * 3 * 16, hits
    assert hits[1 - winner] == 0, hits


def test_a_killed_replica_fails_only_its_running_requests(replicas, start_router):
    """The last test of the module: it kills replicas[1]."""
    alive, doomed = replicas
    body = {"prompt": "", "max_tokens": 32, "ignore_eos": True, "temperature": 0, "stream": True}
    topics = ["Alpha Centauri is", "Bananas grow", "Chess openings", "Dolphins can", "Elephants remember",
              "Forests in winter", "Gravity pulls", "Harbors at night"]
    with start_router("round_robin") as router:
        first_chunk = [threading.Event() for _ in topics]

        def stream(i: int) -> bool:
            """True if the stream ran to [DONE], False if it broke."""
            try:
                with httpx.stream("POST", router.url + "/v1/completions", json={**body, "prompt": topics[i]},
                                  timeout=TIMEOUT, trust_env=False) as r:
                    last = ""
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            first_chunk[i].set()
                            last = line
                    return r.status_code == 200 and last == "data: [DONE]"
            except httpx.HTTPError:
                return False
            finally:
                first_chunk[i].set()

        with ThreadPoolExecutor(len(topics)) as pool:
            results = [pool.submit(stream, i) for i in range(len(topics))]
            deadline = time.monotonic() + TIMEOUT
            for event in first_chunk:
                assert event.wait(max(0.0, deadline - time.monotonic())), "a stream never started"
            running = [httpx.get(r.base_url + "/load", timeout=10).json()["server_load"] for r in replicas]
            assert running == [4, 4], running  # round robin: four streams running on each replica
            doomed.proc.send_signal(signal.SIGKILL)
            outcomes = [f.result(timeout=TIMEOUT * 2) for f in results]
        assert outcomes.count(False) == running[1], outcomes  # only the killed replica's streams broke

        # Right after the kill, before any health check noticed: the router retries elsewhere.
        with router.client() as client, ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: complete(client, f"Right after the kill, request {i}"), range(6)))

            deadline = time.monotonic() + 30
            while router.metric("vllm_router_worker_health", doomed.base_url) != 0:
                assert time.monotonic() < deadline, "the router never marked the killed replica unhealthy"
                time.sleep(0.25)
            decisions = router.metric("vllm_router_policy_decisions_total", doomed.base_url)
            served_before = api_requests(alive)
            list(pool.map(lambda i: complete(client, f"Later request {i}"), range(6)))
        assert router.metric("vllm_router_policy_decisions_total", doomed.base_url) == decisions
        assert api_requests(alive) - served_before == 6
