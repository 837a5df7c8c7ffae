"""Data-parallel serving: two ``tideserve serve`` replicas behind vllm-router, all real processes on loopback.

Checks what docs/deployment.md promises: every request through the router completes (completions and
chat, streamed or not, through the openai SDK); ``cache_aware`` keeps requests that share a long prefix
on one replica, whose prefix-cache hit counter rises while the other's does not; and when a replica is
killed mid-run, only the requests running on it fail, later ones succeed, and once the router has marked
it unhealthy it sends it nothing more. The replicas publish KV cache events (``--kv-events-config``): a
subscriber decodes them, and ``kv_aware`` routes a prefix to the replica whose published cache holds it.
The killing test comes last: it leaves one replica dead.
"""

from __future__ import annotations

import json
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

from tests.kv_events_subscriber import Subscriber, kind, replay_view
from tideserve.bench.launch import ServerProcess, free_port

pytestmark = pytest.mark.slow  # starts processes: run by `make test`, skipped by `-m "not slow"`

pytest.importorskip("vllm_router", reason="vllm-router is in the test extra: pip install -e '.[test]'")
openai = pytest.importorskip("openai")

REPLICA_FLAGS = ["--dtype", "float32", "--max-model-len", "512", "--block-size", "16", "--shutdown-timeout", "5"]
LOAD_TIMEOUT = 180.0
TIMEOUT = 60.0
COMPLETIONS = ("/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def replicas(smollm2_gguf_path) -> Iterator[list[ServerProcess]]:
    """Two replicas, loaded in parallel, one intra-op thread each (the machine has two cores), each
    publishing KV cache events on its own port (``replica.kv_events`` is the address to subscribe to)."""
    servers = []
    for i in range(2):
        port, events_port = free_port(), free_port()
        events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events_port}"})
        cmd = [sys.executable, "-m", "tideserve.cli", "serve", "--port", str(port), *REPLICA_FLAGS,
               "--kv-events-config", events]
        server = ServerProcess(cmd, port, env={"OMP_NUM_THREADS": "1"}, ready_path="/health/ready",
                               ready_timeout_s=LOAD_TIMEOUT, name=f"replica{i}")
        server.kv_events = f"tcp://127.0.0.1:{events_port}"
        servers.append(server)
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
    def start(policy: str, *extra: str) -> Iterator[Router]:
        port, metrics_port = free_port(), free_port()
        cmd = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", *(r.base_url for r in replicas), "--policy", policy,
               "--health-check-interval-secs", "1", "--worker-startup-check-interval", "1",
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port), *extra]
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


def test_a_replica_publishes_its_kv_cache_events(replicas):
    """``tideserve serve --kv-events-config``: vLLM's msgpack batches over ZMQ, decoded by a subscriber
    written from vLLM's format; the stored blocks are the prompt's tokens, chained by parent hash."""
    replica = replicas[0]
    shared = ("Summaries for the library newsletter must list the title, the author and one sentence on why "
              "it is worth reading, in that order, with no spoilers and no more than forty words. Book: ")
    books = ("Dune", "Emma", "Ulysses")
    prompts = [httpx.post(replica.base_url + "/tokenize", json={"prompt": shared + book}, timeout=TIMEOUT,
                          trust_env=False).json()["tokens"] for book in books]
    expected = {tuple(ids[:k]) for ids in prompts for k in range(16, len(ids) + 1, 16)}  # distinct full blocks
    with Subscriber(replica.kv_events) as sub, openai.OpenAI(base_url=replica.base_url + "/v1", api_key="EMPTY",
                                                            max_retries=0, timeout=TIMEOUT) as client:
        sub.poll(0.5)  # let the subscription reach the publisher (a PUB drops what it sends before)
        for book in books:
            complete(client, shared + book, max_tokens=2)
        sub.wait_for(lambda s: sum(len(e.block_hashes) for e in s.events() if kind(e) == "BlockStored")
                     >= len(expected), TIMEOUT, "for every full block")
    stored = [e for e in sub.events() if kind(e) == "BlockStored"]
    first = stored[0]
    assert first.parent_block_hash is None and first.block_size == 16 and first.medium == "GPU"
    # Every event's blocks, as (parent hash, token ids) -> hash: each prompt's full blocks are there, in
    # order, each chained to the one before (the later prompts reuse the shared blocks, stored once).
    blocks = {}
    for e in stored:
        parent = e.parent_block_hash
        for j, h in enumerate(e.block_hashes):
            blocks[(parent, tuple(e.token_ids[16 * j:16 * (j + 1)]))] = h
            parent = h
    for ids in prompts:
        parent = None
        for k in range(len(ids) // 16):
            parent = blocks[(parent, tuple(ids[16 * k:16 * (k + 1)]))]
    assert len({h for e in stored for h in e.block_hashes}) == sum(len(e.block_hashes) for e in stored)
    assert replay_view([b for _, _, b in sub.batches]) >= set(first.block_hashes)


@pytest.fixture(scope="module")
def router_tokenizer(smollm2_gguf_path, tmp_path_factory) -> str:
    """The replicas' tokenizer as files, for ``--kv-event-model``: kv_aware tokenizes each prompt to look
    its blocks up in the published cache."""
    from tideserve.tokenizer.tokenizer import load_tokenizer

    path = tmp_path_factory.mktemp("router-tokenizer")
    load_tokenizer(str(smollm2_gguf_path)).hf.save_pretrained(path)
    return str(path)


def test_kv_aware_routes_a_prefix_to_the_replica_that_published_it(replicas, start_router, router_tokenizer):
    """Each replica is primed directly (not through the router) with its own long prefix; the router
    only learns where they are from the replicas' KV events, and routes each prefix to its replica."""
    prefixes = ["Translate the customer's message into formal French, keep every product code unchanged, "
                "and flag any request for a refund with the word REFUND at the start. Message: ",
                "Classify the support ticket as billing, shipping, returns or other, answer with the single "
                "word only, and never explain the choice or repeat the ticket. Ticket: "]
    sources = [arg for r in replicas for arg in ("--kv-event-source", f"{r.base_url}={r.kv_events}")]
    with start_router("kv_aware", *sources, "--kv-event-block-size", "16", "--kv-event-model",
                      router_tokenizer) as router:
        subscribers = [Subscriber(r.kv_events) for r in replicas]
        try:
            for sub in subscribers:
                sub.poll(0.5)  # the router's own subscriptions were made when it started, before this
            # Prime in the order that defeats the fallback: the router's first choice without events would
            # be the same replica for both prompts, so one of them would go wrong.
            for i in (1, 0):
                with openai.OpenAI(base_url=replicas[i].base_url + "/v1", api_key="EMPTY", max_retries=0,
                                   timeout=TIMEOUT) as direct:
                    complete(direct, prefixes[i] + "hello", max_tokens=2)
                subscribers[i].wait_for(lambda s: any(kind(e) == "BlockStored" for e in s.events()), TIMEOUT,
                                        f"from replica {i}")
            time.sleep(0.5)  # the router received the same batches; give it a moment to index them
            hits_before = [prefix_hits(r) for r in replicas]
            requests_before = [api_requests(r) for r in replicas]
            with router.client() as client:
                for i in (0, 1):
                    complete(client, prefixes[i] + "goodbye", max_tokens=2)
                    served = [api_requests(r) - b for r, b in zip(replicas, requests_before)]
                    assert served[i] == 1 and sum(served) == 1, (i, served)
                    requests_before = [api_requests(r) for r in replicas]
            hits = [prefix_hits(r) - b for r, b in zip(replicas, hits_before)]
            assert all(h >= 2 * 16 for h in hits), hits  # each reused its primed prefix's full blocks (2+)
        finally:
            for sub in subscribers:
                sub.__exit__(None, None, None)


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
