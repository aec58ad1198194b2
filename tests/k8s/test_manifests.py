"""Renders every kustomize overlay under k8s/ and validates it offline against the Kubernetes schemas.

k8s/render.sh installs the pinned kustomize into k8s/.bin from the Go module proxy on first use (needs `go`);
`kubernetes-validate` (the `dev` extra) ships the JSON schemas, so no cluster is needed.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
RENDER = REPO / "k8s" / "render.sh"
OVERLAYS = ("cpu", "gpu", "tp")
# A Kubernetes version whose schemas kubernetes-validate ships; strict mode rejects unknown fields.
KUBERNETES_VERSION = "1.33.0"
GENERATION_PORT = 50051
ADMIN_PORT = 50052
TRAINER_LABEL = {"cbserve.dev/role": "trainer"}

Doc = dict[str, Any]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[Doc]]:
    overlay = request.param
    out = subprocess.run(
        [str(RENDER), overlay], capture_output=True, text=True, timeout=600, check=False, cwd=REPO
    )
    assert out.returncode == 0, f"render.sh {overlay} failed:\n{out.stderr}"
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert docs, f"overlay {overlay} rendered nothing"
    return overlay, docs


def one(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def container(docs: list[Doc]) -> Doc:
    containers = one(docs, "Deployment", "cbserve")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def flag(args: list[str], name: str) -> str:
    """The value of `--name=value` or `--name value` in args."""
    for i, arg in enumerate(args):
        if arg == name:
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} not in {args}")


def test_every_document_validates_strictly(rendered: tuple[str, list[Doc]]) -> None:
    overlay, docs = rendered
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{overlay}: {doc['kind']}/{doc['metadata']['name']}: {e.message} at {list(e.path)}")


def test_expected_resources(rendered: tuple[str, list[Doc]]) -> None:
    _, docs = rendered
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for expected in [
        ("Deployment", "cbserve"),
        ("Service", "cbserve"),
        ("Service", "cbserve-admin"),
        ("NetworkPolicy", "cbserve"),
        ("PodDisruptionBudget", "cbserve"),
        ("HorizontalPodAutoscaler", "cbserve"),
    ]:
        assert expected in kinds
    secrets = [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"]
    assert any(name.startswith("cbserve-admin-token") for name in secrets)


def test_probes_are_grpc_on_the_generation_port(rendered: tuple[str, list[Doc]]) -> None:
    _, docs = rendered
    c = container(docs)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == GENERATION_PORT, probe
        assert "service" not in c[probe]["grpc"], "the overall health status ('') is the one cbserve sets"
    startup = c["startupProbe"]
    # The first conversion of the embedded model takes about 2 minutes.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 180


def test_termination_grace_outlasts_prestop_and_drain(rendered: tuple[str, list[Doc]]) -> None:
    _, docs = rendered
    pod = one(docs, "Deployment", "cbserve")["spec"]["template"]["spec"]
    c = container(docs)
    grace = float(flag(c["args"], "--grace-period"))
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] > grace + float(pre_stop[1])


def test_pod_hardening_and_volumes(rendered: tuple[str, list[Doc]]) -> None:
    _, docs = rendered
    pod = one(docs, "Deployment", "cbserve")["spec"]["template"]["spec"]
    c = container(docs)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert mounts[env["CBSERVE_CACHE_DIR"]] == "cache"
    token_file = flag(c["args"], "--admin-token-file")
    secret_volume = volumes[mounts[str(Path(token_file).parent)]]["secret"]
    secret = one(docs, "Secret", secret_volume["secretName"])
    assert Path(token_file).name in secret["data"]
    assert "CBSERVE_ADMIN_TOKEN" not in env


def test_headless_generation_service(rendered: tuple[str, list[Doc]]) -> None:
    _, docs = rendered
    svc = one(docs, "Service", "cbserve")["spec"]
    assert svc["clusterIP"] == "None"
    assert [p["port"] for p in svc["ports"]] == [GENERATION_PORT]


def test_admin_service_exposes_only_the_admin_port(rendered: tuple[str, list[Doc]]) -> None:
    _, docs = rendered
    svc = one(docs, "Service", "cbserve-admin")["spec"]
    assert svc.get("type", "ClusterIP") == "ClusterIP"
    assert svc.get("clusterIP") != "None"
    assert [p["port"] for p in svc["ports"]] == [ADMIN_PORT]
    assert [p["targetPort"] for p in svc["ports"]] in (["grpc-admin"], [ADMIN_PORT])


def test_network_policy_admits_only_trainers_to_admin(rendered: tuple[str, list[Doc]]) -> None:
    _, docs = rendered
    policy = one(docs, "NetworkPolicy", "cbserve")["spec"]
    pod_labels = one(docs, "Deployment", "cbserve")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["policyTypes"] == ["Ingress"]
    by_port: dict[int, list[Doc]] = {}
    for rule in policy["ingress"]:
        for port in rule["ports"]:
            by_port.setdefault(port["port"], []).extend(rule["from"])
    assert set(by_port) == {GENERATION_PORT, ADMIN_PORT}
    assert by_port[ADMIN_PORT] == [{"podSelector": {"matchLabels": TRAINER_LABEL}}]
    assert by_port[GENERATION_PORT] == [{"podSelector": {}}]


def test_pdb_and_hpa_target_the_deployment(rendered: tuple[str, list[Doc]]) -> None:
    _, docs = rendered
    pod_labels = one(docs, "Deployment", "cbserve")["spec"]["template"]["metadata"]["labels"]
    pdb = one(docs, "PodDisruptionBudget", "cbserve")["spec"]
    assert pdb["selector"]["matchLabels"].items() <= pod_labels.items()
    hpa = one(docs, "HorizontalPodAutoscaler", "cbserve")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "cbserve"}
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "cbserve_requests_waiting"


def test_overlay_specifics(rendered: tuple[str, list[Doc]]) -> None:
    overlay, docs = rendered
    c = container(docs)
    gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
    if overlay == "cpu":
        assert gpus is None
        assert "--model" not in " ".join(c["args"]), "cpu serves the embedded model"
    elif overlay == "gpu":
        assert gpus == 1
        assert flag(c["args"], "--model").startswith("/models/")
    else:
        assert "command" not in c, "tp runs the image's `cbserve serve` entrypoint with --tp"
        assert int(flag(c["args"], "--tp")) == gpus >= 2, "one rank per GPU"
        assert flag(c["args"], "--model").startswith("/models/")
