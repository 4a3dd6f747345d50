"""The Kubernetes manifests (deploy/k8s/) against the Kubernetes API schemas (kubernetes-validate, offline: no
cluster runs here), the rules the service relies on, and the router configuration HAProxy itself accepts."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def documents():
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                yield path.name, document


def test_every_manifest_is_valid_for_kubernetes_strictly():
    kinds = []
    for name, document in documents():
        kubernetes_validate.validate(document, kubernetes_validate.latest_version(), strict=True)
        kinds.append(document["kind"])
    assert sorted(kinds) == sorted(["PersistentVolumeClaim", "Deployment", "Service", "PodDisruptionBudget",
                                    "ConfigMap", "Deployment", "Service"])


def test_the_replicas_drain_before_they_stop_and_share_their_snapshots():
    resources = {(d["kind"], d["metadata"]["name"]): d for _, d in documents()}
    pod = resources["Deployment", "refiner"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    drain_timeout = float(env["WM_REFINER_DRAIN_TIMEOUT_S"]["value"])
    # A drain waits up to drain_timeout_s twice (in-flight work, then the streams' close) and saves between them.
    assert pod["terminationGracePeriodSeconds"] >= 2 * drain_timeout + 30, "SIGKILL must never cut a drain short"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert "/v1/admin/drain" in " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == env["WM_REFINER_SNAPSHOT_DIR"]["value"])
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    claim = resources["PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"], "every replica adopts from the same folder"
    assert env["WM_REFINER_REPLICA_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    labels = resources["Deployment", "refiner"]["spec"]["template"]["metadata"]["labels"]
    for key in (("PodDisruptionBudget", "refiner"),):
        assert resources[key]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert resources["Service", "refiner-replicas"]["spec"]["selector"].items() <= labels.items()


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="needs haproxy (apt-get install haproxy)")
def test_the_routers_configurations_are_accepted_by_haproxy_and_agree(tmp_path):
    config_map = next(d for _, d in documents() if d["kind"] == "ConfigMap")
    k8s = config_map["data"]["haproxy.cfg"]
    local = (DEPLOY / "haproxy.cfg.template").read_text()
    local = local.replace("@ROUTER_BIND@", "127.0.0.1:18999").replace("@STATS_SOCKET@", str(tmp_path / "s.sock"))
    local = local.replace("@SERVERS@", "    server r0 127.0.0.1:1 check\n")
    for name, text in (("k8s.cfg", k8s), ("local.cfg", local)):
        path = tmp_path / name
        path.write_text(text)
        checked = subprocess.run(["haproxy", "-c", "-f", str(path)], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    # The rules that keep a session on one replica are the same in both.
    for rule in ("balance hash path,field(4,/)", "hash-type consistent", "stick on path,field(4,/)",
                 "option httpchk GET /ready", "set-path /v1/sessions/%[var(txn.new_id)]"):
        assert rule in k8s and rule in local, rule
    # Slow and huge heads stop at the router (issue 16 item 5): headers within 10 s, heads within one buffer.
    compose = (DEPLOY / "haproxy-compose.cfg").read_text()
    for rule in ("timeout http-request 10s", "tune.bufsize 32768", "tune.maxrewrite 1024"):
        assert rule in k8s and rule in local and rule in compose, rule
    # The client's address is the router's header, never the client's own (issue 25 item 9).
    for rule in ("option forwardfor", "http-request del-header X-Forwarded-For"):
        assert rule in k8s and rule in local and rule in compose, rule
    assert "WM_REFINER_FORWARDED_ALLOW_IPS=127.0.0.1" in (DEPLOY / "local-cluster.sh").read_text()


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="needs haproxy (apt-get install haproxy)")
def test_docker_compose_runs_the_same_topology():
    """docker-compose.yml: replicas with distinct ids on one shared snapshot volume, the router's config (which
    HAProxy accepts) naming each of them with the template's session rules, Prometheus scraping each."""
    root = DEPLOY.parent
    compose = yaml.safe_load((root / "docker-compose.yml").read_text())
    replicas = {name: service for name, service in compose["services"].items() if name.startswith("refiner-")}
    assert len(replicas) >= 2
    ids = {service["environment"]["WM_REFINER_REPLICA_ID"] for service in replicas.values()}
    assert len(ids) == len(replicas)
    for service in replicas.values():
        assert service["environment"]["WM_REFINER_SNAPSHOT_DIR"] == "/snapshots"
    # Docker kills a replica stop_grace_period after SIGTERM; a drain waits up to drain_timeout_s twice (in-flight
    # work, then the streams' close) and saves between them: room for it with every shipped config (the compose
    # file's comments point at configs/sana-wm.yaml).
    from app.core.settings import load_settings

    drains = [load_settings(path).drain_timeout_s for path in sorted((root / "configs").glob("*.yaml"))
              if path.name != "prometheus.yml"]
    for service in replicas.values():
        grace = service["stop_grace_period"]
        assert grace.endswith("s") and float(grace[:-1]) >= 2 * max(drains) + 30, (grace, drains)
        assert "refiner-snapshots:/snapshots" in service["volumes"]
    config = (DEPLOY / "haproxy-compose.cfg").read_text()
    checked = subprocess.run(["haproxy", "-c", "-f", str(DEPLOY / "haproxy-compose.cfg")], capture_output=True,
                             text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    template = (DEPLOY / "haproxy.cfg.template").read_text()
    backend = template[template.index("backend replicas"):template.index("@SERVERS@")]
    assert backend in config, "the compose router's backend rules are the template's"
    for name in replicas:
        assert f"server {name} {name}:8000 check" in config
    prometheus = yaml.safe_load((root / "configs" / "prometheus.yml").read_text())
    targets = prometheus["scrape_configs"][0]["static_configs"][0]["targets"]
    assert sorted(targets) == sorted(f"{name}:8000" for name in replicas)


def test_the_image_copies_every_package_the_project_installs():
    """The Dockerfile's COPY lines carry every top-level package pyproject installs: `pip install -e .` in the image
    builds from what was copied, so a package left out is missing at run time (the service imports
    wm_refiner_client's spec and formats: without it `python -m app serve` stops with ModuleNotFoundError)."""
    import re
    import tomllib

    root = DEPLOY.parent
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    packages = [pattern.rstrip("*") for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]
    copied = {Path(source).name for line in (root / "Dockerfile").read_text().splitlines()
              if (match := re.match(r"COPY\s+(?!--from)(.+)\s+\S+$", line.strip()))
              for source in match.group(1).split()}
    missing = [package for package in packages if (root / package).is_dir() and package not in copied]
    assert not missing, f"the Dockerfile does not COPY {missing}, which pyproject installs"


def test_the_prestop_hook_drains_with_the_admin_key_from_the_secret(tmp_path):
    """The pod's preStop script, run as Kubernetes runs it (python -c, the pod's environment), against a real
    server that has its own admin key: it sends WM_REFINER_ADMIN_API_KEY (a secret's value, newline and all), not
    the clients' key, and the server drains."""
    import os
    import sys

    import httpx

    from app.core.settings import Settings
    from bench.live import ThreadServer
    from models.checkpoints import write_checkpoint

    pod = next(d for _, d in documents() if d["kind"] == "Deployment" and d["metadata"]["name"] == "refiner")
    container = pod["spec"]["template"]["spec"]["containers"][0]
    env_names = {e["name"] for e in container["env"]}
    assert {"WM_REFINER_API_KEY", "WM_REFINER_ADMIN_API_KEY"} <= env_names
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["python", "-c"]
    settings = Settings(model=str(write_checkpoint(tmp_path / "m", preset="tiny")), device="cpu", dtype="float32",
                        cache_dir=tmp_path / "c", api_key="client-key", admin_api_key="admin-key")
    with ThreadServer(settings) as server:
        script = command[2].replace("http://127.0.0.1:8000", server.base_url)
        environment = {**os.environ, "WM_REFINER_API_KEY": "client-key\n", "WM_REFINER_ADMIN_API_KEY": "admin-key\n"}
        result = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, result.stderr
        ready = httpx.get(f"{server.base_url}/ready", timeout=30)
        assert ready.status_code == 503 and "draining" in ready.text, ready.text
