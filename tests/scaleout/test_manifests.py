"""deploy/ checked against itself and the code it names (no cluster here): selectors match labels, ports
line up, every LORAPLEX_ variable is a setting, probes hit our endpoints, commands are ours, and the
endpoint picker listens where the servers send KV events."""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from loraplex.platform.settings import Settings

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "kubernetes"
HAPROXY_CFG = REPO / "deploy" / "haproxy" / "haproxy.cfg"
CELERY_APP = "loraplex.platform.celery_app:celery"


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def applied() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [doc for name in kustomization["resources"] for doc in documents(K8S / name)]


def one(kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in applied() if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def pod_specs() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(owner name, pod labels, pod spec) of every workload."""
    out = []
    for doc in applied():
        if doc["kind"] in ("Deployment", "Job"):
            template = doc["spec"]["template"]
            out.append((doc["metadata"]["name"], template["metadata"].get("labels", {}), template["spec"]))
    return out


def settings_names() -> set[str]:
    return {f"LORAPLEX_{name.upper()}" for name in Settings.model_fields}


def env_of(name: str) -> dict[str, str]:
    """A workload's loraplex environment: the ConfigMap and Secret it reads, then its own env (literal values)."""
    spec = next(spec for owner, _, spec in pod_specs() if owner == name)
    env: dict[str, str] = {}
    for container in spec["containers"]:
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                env.update(one("ConfigMap", source["configMapRef"]["name"])["data"])
            if "secretRef" in source:
                (secret,) = documents(K8S / "secret.example.yaml")
                assert secret["metadata"]["name"] == source["secretRef"]["name"]
                env.update(secret["stringData"])
        env.update({e["name"]: e.get("value", "<from the pod>") for e in container.get("env", [])})
    return env


def test_every_listed_file_exists_and_parses() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for name in kustomization["resources"]:
        assert (K8S / name).is_file(), name
    kinds = {d["kind"] for d in applied()}
    assert {"Deployment", "Service", "InferencePool", "HTTPRoute", "ConfigMap", "Job"} <= kinds


def test_selectors_match_the_labels_they_select() -> None:
    for doc in applied():
        if doc["kind"] == "Deployment":
            labels = doc["spec"]["template"]["metadata"]["labels"]
            assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items(), doc["metadata"]["name"]
    workloads = {owner: labels for owner, labels, _ in pod_specs()}
    for doc in applied():
        selector = (doc["spec"].get("selector") if doc["kind"] == "Service"
                    else doc["spec"]["selector"]["matchLabels"] if doc["kind"] in ("InferencePool", "PodDisruptionBudget")
                    else None)
        if selector is None:
            continue
        matched = [owner for owner, labels in workloads.items() if selector.items() <= labels.items()]
        assert matched, f"{doc['kind']} {doc['metadata']['name']} selects no pod"
        if doc["kind"] != "Service" or doc["metadata"]["name"] == "loraplex":
            assert matched == ["loraplex-server"], (doc["metadata"]["name"], matched)


def test_the_pool_members_look_like_vllm_to_the_picker() -> None:
    server_labels = next(labels for owner, labels, _ in pod_specs() if owner == "loraplex-server")
    assert server_labels["llm-d.ai/engine-type"] == "vllm"
    pool = one("InferencePool", "loraplex")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    server = next(spec for owner, _, spec in pod_specs() if owner == "loraplex-server")["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [ports["http"]] == [int(env_of("loraplex-server")["LORAPLEX_PORT"])]
    picker = pool["spec"]["endpointPickerRef"]
    service = one("Service", picker["name"])
    assert picker["port"]["number"] in {p["port"] for p in service["spec"]["ports"]}
    route = one("HTTPRoute", "loraplex")
    assert route["spec"]["rules"][0]["backendRefs"][0] == {"group": "inference.networking.k8s.io",
                                                          "kind": "InferencePool", "name": "loraplex"}
    # the picker reads our metrics under vLLM's names, from the path we serve them on
    epp = next(spec for owner, _, spec in pod_specs() if owner == "loraplex-epp")["containers"][0]
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in epp["args"])
    assert flags["pool-name"] == pool["metadata"]["name"] and flags["model-server-metrics-path"] == "/metrics"
    for flag in ("total-queued-requests-metric", "kv-cache-usage-percentage-metric", "lora-info-metric",
                 "cache-info-metric"):
        assert flags[flag].startswith("vllm:"), flag
    routes = {route.path for route in _app_routes()}
    assert "/metrics" in routes


def test_kv_events_go_where_the_picker_listens() -> None:
    env = env_of("loraplex-server")
    host, port = re.fullmatch(r"tcp://([\w.-]+):(\d+)", env["LORAPLEX_KV_EVENTS_ENDPOINT"]).groups()  # type: ignore[union-attr]
    service = one("Service", host)
    assert int(port) in {p["port"] for p in service["spec"]["ports"]}
    config = yaml.safe_load(one("ConfigMap", "loraplex-epp-config")["data"]["epp-config.yaml"])
    (scorer,) = [p for p in config["plugins"] if p["type"] == "precise-prefix-cache-scorer"]
    events = scorer["parameters"]["kvEventsConfig"]
    assert events["zmqEndpoint"] == f"tcp://*:{port}" and events["topicFilter"] == "kv@"
    assert scorer["parameters"]["tokenProcessorConfig"]["blockSize"] == int(env["LORAPLEX_KV_BLOCK_SIZE"])
    referenced = {p["pluginRef"] for profile in config["schedulingProfiles"] for p in profile["plugins"]}
    assert referenced <= {p["type"] for p in config["plugins"]}


def test_every_loraplex_variable_is_a_setting() -> None:
    known = settings_names()
    for owner, _, _ in pod_specs():
        names = {n for n in env_of(owner) if n.startswith("LORAPLEX_")}
        assert names <= known, (owner, names - known)
    variables = set(re.findall(r"\$\{(LORAPLEX_\w+)\}", HAPROXY_CFG.read_text()))
    assert variables and not variables & known  # the balancer's own, never mistaken for a server setting
    run = (REPO / "deploy" / "haproxy" / "run.sh").read_text()
    server_vars = set(re.findall(r"\b(LORAPLEX_\w+)=", run)) | set(re.findall(r"\$\{(LORAPLEX_\w+)", run))
    assert server_vars - variables <= known, server_vars - variables - known


def test_probes_hit_our_endpoints_on_a_named_port() -> None:
    routes = {route.path for route in _app_routes()}
    for owner, _, spec in pod_specs():
        for container in spec["containers"]:
            ports = {p["name"] for p in container.get("ports", [])}
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                http = container.get(probe, {}).get("httpGet")
                if http is None:
                    continue
                assert http["path"] in routes and http["port"] in ports, (owner, probe, http)
    server = next(spec for owner, _, spec in pod_specs() if owner == "loraplex-server")
    assert server["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/readyz"
    drain = float(env_of("loraplex-server")["LORAPLEX_DRAIN_TIMEOUT_S"])
    assert server["terminationGracePeriodSeconds"] > drain
    assert "option httpchk GET /readyz" in HAPROXY_CFG.read_text()


def test_commands_are_ours() -> None:
    from loraplex.platform.cli.main import app
    from typer.main import get_command

    cli = get_command(app)
    for owner, _, spec in pod_specs():
        command = spec["containers"][0].get("command")
        if owner == "loraplex-epp":
            continue
        assert command, owner
        if command[0] == "loraplex":
            group = cli
            for word in command[1:]:
                group = group.commands[word]  # type: ignore[attr-defined]
            assert not hasattr(group, "commands"), f"{command} is a group"
        else:
            assert command[0] == "celery" and command[command.index("-A") + 1] == CELERY_APP, command
            assert {"worker", "beat"} & set(command)
    servers = [spec for owner, _, spec in pod_specs() if owner == "loraplex-server"]
    assert servers[0]["containers"][0]["command"] == ["loraplex", "serve"]
    assert servers[0]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert one("Deployment", "loraplex-beat")["spec"]["replicas"] == 1
    assert one("Job", "loraplex-migrate")["spec"]["template"]["spec"]["containers"][0]["command"] == \
        ["loraplex", "db", "upgrade"]


def test_the_workers_see_the_adapters_where_the_servers_write_them() -> None:
    storage = env_of("loraplex-server")["LORAPLEX_ADAPTER_STORAGE_DIR"]
    for owner in ("loraplex-server", "loraplex-worker"):
        spec = next(spec for name, _, spec in pod_specs() if name == owner)
        mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes[mounts[storage]]["persistentVolumeClaim"]["claimName"] == "loraplex-adapters"
        assert env_of(owner)["LORAPLEX_ADAPTER_STORAGE_DIR"] == storage
    claim = one("PersistentVolumeClaim", "loraplex-adapters")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


@pytest.mark.skipif(subprocess.run(["which", "haproxy"], capture_output=True).returncode != 0,
                    reason="haproxy is not installed (make test installs it)")
def test_the_haproxy_example_is_valid_haproxy() -> None:
    env = {"LORAPLEX_LB_BIND": "127.0.0.1:18000", "LORAPLEX_LB_LOG": "stdout",
           "LORAPLEX_REPLICA_1": "127.0.0.1:18001", "LORAPLEX_REPLICA_2": "127.0.0.1:18002", "PATH": "/usr/sbin:/usr/bin"}
    checked = subprocess.run(["haproxy", "-c", "-f", str(HAPROXY_CFG)], capture_output=True, text=True, env=env)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    run = REPO / "deploy" / "haproxy" / "run.sh"
    assert subprocess.run(["bash", "-n", str(run)]).returncode == 0
    assert '"$LORAPLEX" serve &' in run.read_text()


@functools.cache
def _app_routes() -> list[Any]:
    from loraplex.platform.routers import all_routers

    return [route for router in all_routers() for route in router.routes]
