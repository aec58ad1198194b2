"""Renders every kustomize overlay under k8s/ and validates it offline against the Kubernetes schemas.

k8s/render.sh installs the pinned kustomize into k8s/.bin from the Go module proxy on first use (needs `go`);
`kubernetes-validate` (the `dev` extra) ships the JSON schemas, so no cluster is needed.
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
RENDER = REPO / "k8s" / "render.sh"
OVERLAYS = ("cpu", "gpu", "tp", "gateway")
# A Kubernetes version whose schemas kubernetes-validate ships; strict mode rejects unknown fields.
KUBERNETES_VERSION = "1.33.0"
GENERATION_PORT = 50051
ADMIN_PORT = 50052
TRAINER_LABEL = {"cbserve.dev/role": "trainer"}
# The gateway overlay: SMG (Shepherd Model Gateway) in front of the cpu overlay's cbserve pods.
GATEWAY = "gateway"
GATEWAY_DOCKERFILE = REPO / "k8s" / "overlays" / GATEWAY / "Dockerfile"

Doc = dict[str, Any]


@functools.cache
def render(overlay: str) -> tuple[Doc, ...]:
    out = subprocess.run(
        [str(RENDER), overlay], capture_output=True, text=True, timeout=600, check=False, cwd=REPO
    )
    assert out.returncode == 0, f"render.sh {overlay} failed:\n{out.stderr}"
    docs = tuple(d for d in yaml.safe_load_all(out.stdout) if d)
    assert docs, f"overlay {overlay} rendered nothing"
    return docs


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[Doc]]:
    return request.param, list(render(request.param))


@pytest.fixture(scope="module")
def gateway() -> list[Doc]:
    return list(render(GATEWAY))


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


def test_cpu_limit_equals_the_request(rendered: tuple[str, list[Doc]]) -> None:
    """The server takes its thread count from the CPU limit (its cgroup's quota): one equal to the
    request gives a thread per reserved core, and without one it would run a thread per node core."""
    resources = container(rendered[1])["resources"]
    assert resources["limits"]["cpu"] == resources["requests"]["cpu"], resources


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
    client = {"app": "client"}
    assert admits(docs, pod_labels, client, GENERATION_PORT)
    assert admits(docs, pod_labels, TRAINER_LABEL, ADMIN_PORT)
    for source in (client, pod_labels):
        assert not admits(docs, pod_labels, source, ADMIN_PORT)
    # A weight-update group's ranks listen on ports the OS picks: trainers and other replicas reach them.
    for port in (1024, 40000, 50053, 65535):
        assert admits(docs, pod_labels, TRAINER_LABEL, port)
        assert admits(docs, pod_labels, pod_labels, port)
        assert not admits(docs, pod_labels, client, port)


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
    if overlay in ("cpu", GATEWAY):
        # The gateway overlay puts SMG in front of the cpu overlay's cbserve.
        assert gpus is None
        assert "--model" not in " ".join(c["args"]), "cpu serves the embedded model"
    elif overlay == "gpu":
        assert gpus == 1
        assert flag(c["args"], "--model").startswith("/models/")
    else:
        assert overlay == "tp"
        assert "command" not in c, "tp runs the image's `cbserve serve` entrypoint with --tp"
        assert int(flag(c["args"], "--tp")) == gpus >= 2, "one rank per GPU"
        assert flag(c["args"], "--model").startswith("/models/")


def test_only_the_gateway_overlay_runs_smg(rendered: tuple[str, list[Doc]]) -> None:
    overlay, docs = rendered
    smg = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "smg"]
    assert len(smg) == (1 if overlay == GATEWAY else 0)


# --- the gateway overlay: SMG in front of cbserve ---


def pod_template(docs: list[Doc], name: str) -> Doc:
    return one(docs, "Deployment", name)["spec"]["template"]


def smg_container(docs: list[Doc]) -> Doc:
    [c] = pod_template(docs, "smg")["spec"]["containers"]
    return c


def list_flag(args: list[str], name: str) -> list[str]:
    """The values of `--name v1 v2 ...` (argparse nargs='+'): every arg after it up to the next `--` flag."""
    i = args.index(name)
    values = []
    for arg in args[i + 1 :]:
        if arg.startswith("--"):
            break
        values.append(arg)
    assert values, f"{name} has no values in {args}"
    return values


def container_port(c: Doc, ref: int | str) -> int:
    """A probe's or Service's target port (a number or a container port's name) as a number."""
    if isinstance(ref, int):
        return ref
    [port] = [p["containerPort"] for p in c["ports"] if p["name"] == ref]
    return port


def env_source(c: Doc, value: str) -> Doc:
    """Where `$(VAR)` in an arg comes from: the env entry's valueFrom (Kubernetes expands it in args)."""
    match = re.fullmatch(r"\$\((\w+)\)", value)
    assert match, f"{value!r} is not a $(VAR) reference"
    [entry] = [e for e in c["env"] if e["name"] == match.group(1)]
    return entry["valueFrom"]


def selects(selector: Doc, labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels is checked here: {selector}"
    return selector.get("matchLabels", {}).items() <= labels.items()


def admits(docs: list[Doc], to_labels: dict[str, str], from_labels: dict[str, str], port: int) -> bool:
    """Whether the NetworkPolicies let a pod with from_labels reach port on a pod with to_labels, both in the
    overlay's (one) namespace: allowed when no policy isolates the target for ingress, else when some rule of
    a policy selecting it matches the port and the source."""
    isolating = [
        d["spec"]
        for d in docs
        if d["kind"] == "NetworkPolicy"
        and "Ingress" in d["spec"].get("policyTypes", ["Ingress"])
        and selects(d["spec"]["podSelector"], to_labels)
    ]
    if not isolating:
        return True
    for policy in isolating:
        for rule in policy.get("ingress", []):
            port_ok = "ports" not in rule or any(
                p.get("port") == port or p.get("port", 0) <= port <= p.get("endPort", -1)
                for p in rule["ports"]
            )
            peer_ok = "from" not in rule or any(
                set(peer) == {"podSelector"} and selects(peer["podSelector"], from_labels)
                for peer in rule["from"]
            )
            if port_ok and peer_ok:
                return True
    return False


def test_gateway_discovers_the_cbserve_pods(gateway: list[Doc]) -> None:
    c = smg_container(gateway)
    args = c["args"]
    assert c["command"] == ["smg", "launch"]
    assert "--service-discovery" in args
    assert flag(args, "--backend") == "vllm", "cbserve speaks vllm.grpc.engine.VllmEngine on 50051"
    # The selector: every label must match, so it has to match cbserve's pods and not SMG's own.
    selector = dict(pair.split("=", 1) for pair in list_flag(args, "--selector"))
    cbserve_labels = pod_template(gateway, "cbserve")["metadata"]["labels"]
    smg_labels = pod_template(gateway, "smg")["metadata"]["labels"]
    assert selector.items() <= cbserve_labels.items()
    assert not selector.items() <= smg_labels.items()
    # cbserve's Generation port, where it serves the gateways' protocol.
    port = int(flag(args, "--service-discovery-port"))
    assert port == GENERATION_PORT
    assert port == container_port(container(gateway), "grpc")
    # The namespace SMG watches is the pod's own, which is where the Role and every other resource go too.
    source = env_source(c, flag(args, "--service-discovery-namespace"))
    assert source == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert {d["metadata"].get("namespace") for d in gateway} == {None}, "applied with `kubectl apply -n`"
    # New pods register within seconds, not the default 30 s.
    assert float(flag(args, "--worker-startup-check-interval")) <= 5


def test_behind_the_gateway_cbserve_uses_pages_the_gateway_can_match(gateway: list[Doc]) -> None:
    """SMG routes by full KV blocks of the pods' page size: 256-token pages hide shorter shared prefixes."""
    assert int(flag(container(gateway)["args"], "--page-size")) == 16


def test_gateway_service_account_may_watch_pods_in_its_namespace(gateway: list[Doc]) -> None:
    pod = pod_template(gateway, "smg")["spec"]
    account = one(gateway, "ServiceAccount", pod["serviceAccountName"])
    assert pod.get("automountServiceAccountToken", account.get("automountServiceAccountToken", True)) is True
    granted: set[str] = set()
    for binding in (d for d in gateway if d["kind"] == "RoleBinding"):
        subjects = binding.get("subjects", [])
        # No subject namespace in a RoleBinding means the binding's own namespace.
        if not any(
            s["kind"] == "ServiceAccount"
            and s["name"] == account["metadata"]["name"]
            and s.get("namespace") == binding["metadata"].get("namespace")
            for s in subjects
        ):
            continue
        assert binding["roleRef"]["kind"] == "Role", "namespaced: a Role, not a ClusterRole"
        role = one(gateway, "Role", binding["roleRef"]["name"])
        for rule in role["rules"]:
            if "" in rule["apiGroups"] and "pods" in rule["resources"]:
                granted |= set(rule["verbs"])
    assert {"get", "list", "watch"} <= granted
    assert not [d for d in gateway if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]


def test_gateway_service_exposes_the_http_port(gateway: list[Doc]) -> None:
    c = smg_container(gateway)
    svc = one(gateway, "Service", "smg")["spec"]
    smg_labels = pod_template(gateway, "smg")["metadata"]["labels"]
    cbserve_labels = pod_template(gateway, "cbserve")["metadata"]["labels"]
    assert svc.get("type", "ClusterIP") == "ClusterIP"
    assert svc["selector"].items() <= smg_labels.items()
    assert not svc["selector"].items() <= cbserve_labels.items()
    [http] = [p for p in svc["ports"] if p["name"] == "http"]
    assert container_port(c, http["targetPort"]) == int(flag(c["args"], "--port"))
    [metrics] = [p for p in svc["ports"] if p["name"] == "metrics"]
    assert container_port(c, metrics["targetPort"]) == int(flag(c["args"], "--prometheus-port"))
    assert flag(c["args"], "--host") == flag(c["args"], "--prometheus-host") == "0.0.0.0"


def test_gateway_probes(gateway: list[Doc]) -> None:
    c = smg_container(gateway)
    probe_ports = {int(flag(c["args"], "--port")), int(flag(c["args"], "--health-check-port"))}
    for probe, path in (("livenessProbe", "/liveness"), ("readinessProbe", "/readiness")):
        get = c[probe]["httpGet"]
        assert get["path"] == path, probe
        assert container_port(c, get["port"]) in probe_ports, probe


def test_gateway_may_reach_cbserve_generation_only(gateway: list[Doc]) -> None:
    cbserve_labels = pod_template(gateway, "cbserve")["metadata"]["labels"]
    smg_labels = pod_template(gateway, "smg")["metadata"]["labels"]
    assert admits(gateway, cbserve_labels, smg_labels, GENERATION_PORT)
    assert not admits(gateway, cbserve_labels, smg_labels, ADMIN_PORT)
    # Clients in the namespace reach the gateway's API; what reaches cbserve's admin port is unchanged.
    c = smg_container(gateway)
    assert admits(gateway, smg_labels, {"app": "client"}, int(flag(c["args"], "--port")))
    assert admits(gateway, cbserve_labels, TRAINER_LABEL, ADMIN_PORT)
    assert not admits(gateway, cbserve_labels, {"app": "client"}, ADMIN_PORT)


def test_gateway_pod_hardening_and_shutdown(gateway: list[Doc]) -> None:
    pod = pod_template(gateway, "smg")["spec"]
    c = smg_container(gateway)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    # The tokenizer fetched from a worker is unpacked in the temporary directory: it must be writable.
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert "emptyDir" in volumes[mounts[env.get("TMPDIR", "/tmp")]]
    # SIGTERM: 5 s with the listener open while endpoints drop the pod, then the drain.
    assert pod["terminationGracePeriodSeconds"] > 5 + float(flag(c["args"], "--shutdown-grace-period-secs"))


def test_gateway_image_is_the_pinned_smg(gateway: list[Doc]) -> None:
    image = smg_container(gateway)["image"]
    name, tag = image.rsplit(":", 1)
    assert name == "smg"
    dockerfile = GATEWAY_DOCKERFILE.read_text()
    assert f"ARG SMG_VERSION={tag}\n" in dockerfile
    assert '"smg==${SMG_VERSION}"' in dockerfile
    assert re.search(r"^USER 10001", dockerfile, re.MULTILINE), "non-root, the pod's runAsUser"
