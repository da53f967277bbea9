"""deploy/ checked offline: every Kubernetes manifest against the API schemas
(kubernetes-validate, strict: unknown fields fail), and every command in deploy/ run through the
real parser of the program it starts, so a flag that does not exist, or an endpoint list that
does not name the etcd members the same files define, fails here and not in a cluster.

Why the PyTorchJob is validated through its pod template: its CRD schema (Kubeflow's) is not
among kubernetes-validate's built-in ones, so its template is checked as a core/v1 PodTemplate
and the rest (kind, replica spec names, elastic range) field by field.
"""

from __future__ import annotations

import hashlib
import importlib
import re
import sys
from pathlib import Path

import kubernetes_validate as kv
import pytest
import yaml
from layout import ROOT

from etcdrun.agent.cli import parse_args
from etcdrun.agent.report.health import PATHS

DEPLOY = ROOT / "deploy"
K8S_VERSIONS = ("1.29.0", "1.37.0")  # the oldest the manifests support, the newest known
POD_IP = "10.1.2.3"  # a stand-in for status.podIP when expanding $(POD_IP)


def docs(name: str) -> dict[str, dict]:
    """The manifests of deploy/k8s/<name>, keyed by 'Kind/name'."""
    out = {}
    for d in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()):
        out[f"{d['kind']}/{d['metadata']['name']}"] = d
    return out


def container(pod_spec: dict) -> dict:
    (c,) = pod_spec["containers"]
    return c


def expand(args: list[str], c: dict, owner: dict) -> list[str]:
    """Kubernetes' $(VAR) expansion from the container's env (fieldRefs given stand-in values,
    as the kubelet would give real ones).
    """
    values = {}
    for e in c.get("env", []):
        if "value" in e:
            values[e["name"]] = e["value"]
            continue
        path = e["valueFrom"]["fieldRef"]["fieldPath"]
        if path == "status.podIP":
            values[e["name"]] = POD_IP
        elif path == "metadata.name":
            values[e["name"]] = f"{owner['metadata']['name']}-0"
        elif path == "metadata.labels['batch.kubernetes.io/job-name']":
            values[e["name"]] = owner["metadata"]["name"]
        else:
            raise AssertionError(f"no stand-in for fieldRef {path}")
    return [re.sub(r"\$\((\w+)\)", lambda m: values.get(m[1], m[0]), a) for a in args]


def flags(args: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)


@pytest.mark.parametrize("name", ["etcd.yaml", "agent-job.yaml"])
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_validate(name: str, version: str) -> None:
    for key, d in docs(name).items():
        try:
            kv.validate(d, version, strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{name} {key} (Kubernetes {version}): {e.message}", pytrace=False)


def etcd_members() -> tuple[list[str], int]:
    """The member endpoints the etcd manifest defines ('etcd-0.etcd:2379', ...), checked for
    agreement between Service, StatefulSet and etcd's own flags on the way.
    """
    m = docs("etcd.yaml")
    svc, sts = m["Service/etcd"], m["StatefulSet/etcd"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert m["Service/etcd-client"]["spec"]["selector"].items() <= labels.items()
    ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
    c = container(sts["spec"]["template"]["spec"])
    assert c["image"].split(":")[0] == "etcdrun/etcd" and c["command"][0] == "etcd"
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == ports
    f = flags(expand(c["command"], c, sts))
    n, sts_name, svc_name = (
        sts["spec"]["replicas"],
        sts["metadata"]["name"],
        svc["metadata"]["name"],
    )
    names = [f"{sts_name}-{i}" for i in range(n)]
    assert f["name"] == names[0]  # $(POD_NAME), here for pod 0
    assert f["initial-cluster"] == ",".join(
        f"{p}=http://{p}.{svc_name}:{ports['peer']}" for p in names
    )
    assert f["listen-client-urls"].endswith(f":{ports['client']}")
    assert f["listen-peer-urls"].endswith(f":{ports['peer']}")
    assert f["advertise-client-urls"] == f"http://{names[0]}.{svc_name}:{ports['client']}"
    probe = c["readinessProbe"]
    assert list(probe)[0] != "httpGet" and probe["exec"]["command"][0] == "etcdctl"
    return [f"{p}.{svc_name}:{ports['client']}" for p in names], n


def test_agent_job_command_is_a_real_etcdrun_command() -> None:
    job = docs("agent-job.yaml")["Job/etcdrun-job"]
    pod = job["spec"]["template"]["spec"]
    c = container(pod)
    assert c["image"].split(":")[0] == "etcdrun/agent"
    assert c["command"][0] == "etcdrun"
    config, entrypoint, args = parse_args(expand(c["command"], c, job)[1:])
    endpoints, _ = etcd_members()
    assert config.rdzv_backend == "etcd"
    assert config.rdzv_endpoint.split(",") == endpoints
    assert config.run_id == job["metadata"]["name"]
    assert config.local_addr == POD_IP
    assert config.min_nodes <= job["spec"]["parallelism"] <= config.max_nodes
    # SIGTERM -> workers get stop_grace, then the lease is revoked: the pod must outlive that.
    assert config.stop_grace is not None
    assert pod["terminationGracePeriodSeconds"] >= config.stop_grace + 5
    script = args[1]  # python -u <script>
    assert (ROOT / script).is_file() and c["workingDir"] == dockerfile_workdir()
    # The probes ask the agent's health port (agent/report/health.py): the one --metrics-port names.
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert config.metrics_cfg == {"port": str(ports["health"])}
    ready, live = c["readinessProbe"]["httpGet"], c["livenessProbe"]["httpGet"]
    assert (ready["path"], ready["port"]) == ("/healthz", "health")
    assert (live["path"], live["port"]) == ("/livez", "health")  # never /healthz: spares wait
    assert {ready["path"], live["path"]} <= set(PATHS)


def dockerfile_workdir() -> str:
    text = (DEPLOY / "images" / "agent.Dockerfile").read_text()
    return re.findall(r"^WORKDIR\s+(\S+)", text, re.M)[-1]


def test_pytorchjob_runs_torchrun_with_the_etcd_v3_plugin(torch_available: None) -> None:
    from torch.distributed.run import parse_args as torchrun_args

    job = docs("pytorchjob.yaml")["PyTorchJob/etcdrun-ddp"]
    assert job["apiVersion"] == "kubeflow.org/v1"
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "w"}}
    for version in K8S_VERSIONS:
        kv.validate({**template, "template": worker["template"]}, version, strict=True)
    c = container(worker["template"]["spec"])
    assert c["name"] == "pytorch" and c["image"].split(":")[0] == "etcdrun/agent-torch"
    assert c["command"][0] == "torchrun"
    ns = torchrun_args(expand(c["command"], c, job)[1:])
    assert ns.rdzv_backend == "etcd-v3"
    host, port = ns.rdzv_endpoint.split(":")
    client = docs("etcd.yaml")["Service/etcd-client"]
    assert (host, int(port)) == (client["metadata"]["name"], client["spec"]["ports"][0]["port"])
    assert ns.nnodes == "2:4" and ns.local_addr == POD_IP and ns.rdzv_id == "etcdrun-ddp"
    elastic = job["spec"]["elasticPolicy"]
    assert f"{elastic['minReplicas']}:{elastic['maxReplicas']}" == ns.nnodes
    assert ns.training_script == "examples/ddp_elastic.py"
    # The example's own parser takes the job's arguments, and its checkpoints are on a volume
    # every pod mounts read-write, so a replacement pod resumes from them.
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        script = importlib.import_module("ddp_elastic").parse_args(ns.training_script_args)
    finally:
        sys.path.remove(str(ROOT / "examples"))
    (mount,) = [m for m in c["volumeMounts"] if str(script.checkpoint_dir) == m["mountPath"]]
    (vol,) = [v for v in worker["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    claim = docs("pytorchjob.yaml")[
        f"PersistentVolumeClaim/{vol['persistentVolumeClaim']['claimName']}"
    ]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for version in K8S_VERSIONS:
        kv.validate(claim, version, strict=True)


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def compose_defaults(value: str) -> str:
    """${VAR:-default} as compose expands it with VAR unset."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def test_compose_agent_command_is_a_real_etcdrun_command() -> None:
    services = compose()["services"]
    members = [s for s in services if s.startswith("etcd")]
    assert members == ["etcd1", "etcd2", "etcd3"]
    for s in members:
        svc = services[s]
        assert svc["healthcheck"]["test"][:2] == ["CMD", "etcdctl"]  # the image has no shell
        assert f"--name={s}" in svc["command"]
        assert f"{s}=http://{s}:2380" in svc["environment"]["ETCD_INITIAL_CLUSTER"]
        assert compose_defaults(svc["image"]) == "etcdrun/etcd:latest"
    agent = services["agent"]
    assert compose_defaults(agent["image"]) == "etcdrun/agent:latest"
    assert agent["command"][0] == "etcdrun"
    config, _, args = parse_args([compose_defaults(a) for a in agent["command"][1:]])
    assert config.rdzv_endpoint.split(",") == [f"{s}:2379" for s in members]
    assert (config.min_nodes, config.max_nodes, config.rdzv_backend) == (2, 4, "etcd")
    assert (ROOT / args[1]).is_file()
    assert set(agent["depends_on"]) == set(members)


def test_etcd_rootfs_tar_is_deterministic(tmp_path: Path) -> None:
    """The etcd base's key is the hash of what goes in; the same files give the same bytes."""
    sys.path.insert(0, str(DEPLOY / "images"))
    try:
        import rootfs
    finally:
        sys.path.remove(str(DEPLOY / "images"))
    a, b = tmp_path / "etcd", tmp_path / "lib.so"
    a.write_bytes(b"etcd binary")
    b.write_bytes(b"libc")
    files = {"usr/local/bin/etcd": a, "lib/x86_64-linux-gnu/libc.so.6": b}
    shas = []
    for out in ("one.tar", "two.tar"):
        rootfs.write_etcd_rootfs(files, tmp_path / out)
        shas.append(hashlib.sha256((tmp_path / out).read_bytes()).hexdigest())
    assert shas[0] == shas[1]
    key = rootfs.etcd_rootfs_key(files)
    b.write_bytes(b"libc, patched")
    assert rootfs.etcd_rootfs_key(files) != key
