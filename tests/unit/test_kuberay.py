"""deploy/kuberay/: the KubeRay manifests, validated offline as a cluster would.

- Every rendered file is what the Serve configs render now (``python -m
  cluster.kuberay --check``): a config changed without its manifest fails here.
- What kustomize builds of each variant (what ``kubectl kustomize`` gives an operator,
  built by cluster/kustomize.py so no kubectl is needed; where kubectl is installed the
  two builds are compared): the RayService against the vendored RayService CRD, turned
  into a strict JSON Schema by KubeRay's own converter
  (third_party/kuberay/openapi2jsonschema.py; an unknown field anywhere is an error);
  the core kinds against Kubernetes' schemas (``kubernetes-validate``, strict); the
  PodMonitor against what it must select. A kustomize feature the builder lacks fails.
- The embedded ``serveConfigV2`` against Ray's ``ServeDeploySchema``, and each of its
  applications imported and built with its ``args`` (no engine starts, no GPU).
- The KubeRay operator's admission rules that apply to a RayService
  (third_party/kuberay/validation.go: ``ValidateRayServiceMetadata``,
  ``ValidateRayServiceSpec``, ``ValidateRayClusterSpec``), ported below; each
  rule is shown to refuse a manifest broken its way.
- Secrets come from the Secret only; the Ray Serve settings equal the Makefile's and
  the image's; the GPU groups hold the GPUs their models need."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from cluster import kuberay, kustomize

ROOT = Path(__file__).resolve().parents[2]
VENDORED = ROOT / "third_party" / "kuberay"
KUBERNETES_VERSION = "1.32"  # the oldest Kubernetes KubeRay v1.7 supports that kubernetes-validate knows


@pytest.fixture(scope="module")
def rayservice_schema(tmp_path_factory) -> dict:
    """KubeRay's converter run on the vendored CRD, root included (unknown fields anywhere fail)."""
    where = tmp_path_factory.mktemp("schema")
    subprocess.run(
        [sys.executable, str(VENDORED / "openapi2jsonschema.py"), str(VENDORED / "ray.io_rayservices.yaml")],
        cwd=where,
        env={**os.environ, "DENY_ROOT_ADDITIONAL_PROPERTIES": "1"},
        check=True,
        capture_output=True,
    )
    return json.loads((where / "rayservice_v1.json").read_text())


def built(variant: str, deploy: Path = kuberay.DEPLOY) -> list[dict]:
    """What `kubectl kustomize deploy/kuberay/<variant>` gives an operator, built without
    kubectl (cluster/kustomize.py; compared with kubectl's build below, where it is)."""
    return kustomize.build(deploy / variant)


def kubectl_kustomize(directory: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the Python kustomize build is compared with kubectl's where it is")
    out = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, check=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def validate_built(docs: list[dict], rayservice_schema: dict) -> None:
    """Raises where a cluster would refuse what was built: the RayService against KubeRay's
    CRD, the core kinds against Kubernetes' schemas (both strict), the PodMonitor's selection."""
    for doc in docs:
        if doc["kind"] == "RayService":
            jsonschema.validate(doc, rayservice_schema)
        elif doc["kind"] == "PodMonitor":  # Prometheus Operator's CRD is not vendored: what it must hold
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            assert doc["spec"]["selector"]["matchLabels"] == kuberay.POD_LABELS
            assert [e["port"] for e in doc["spec"]["podMetricsEndpoints"]] == ["metrics"]
        else:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def rayservice_of(variant: str) -> dict:
    return yaml.safe_load((kuberay.DEPLOY / variant / "rayservice.yaml").read_text())


def containers(service: dict) -> list[dict]:
    cluster = service["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    return [c for pod in pods for c in pod["spec"]["containers"]]


# -- KubeRay's admission rules for a RayService, ported from validation.go ------------

MAX_RAYSERVICE_NAME = 53 - 6  # MaxRayClusterNameLength - 6 (KubeRay's utils/constant.go)
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
UPGRADE_TYPES = ("NewClusterWithIncrementalUpgrade", "NewCluster", "None")
GCS_FT_ANNOTATION = "ray.io/ft-enabled"


def kuberay_refusals(service: dict) -> list[str]:
    """What KubeRay's ValidateRayServiceMetadata and ValidateRayServiceSpec (with
    ValidateRayClusterSpec) would refuse in ``service``; empty when it passes."""
    errors = []
    meta, spec = service["metadata"], service["spec"]
    name = meta.get("name", "")
    if len(name) > MAX_RAYSERVICE_NAME:
        errors.append(f"RayService name should be no more than {MAX_RAYSERVICE_NAME} characters")
    if not DNS1035.match(name) or len(name) > 63:
        errors.append("RayService name should be a valid DNS1035 label")
    timeout = (meta.get("annotations") or {}).get("ray.io/initializing-timeout")
    if timeout and not re.fullmatch(r"([1-9]\d*)|(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+", timeout):
        errors.append("annotation ray.io/initializing-timeout has invalid format")
    cluster = spec["rayClusterConfig"]
    if (cluster.get("authOptions") or {}).get("enableK8sTokenAuth"):
        errors.append("K8s token auth mode is currently not supported for RayService")
    head = cluster["headGroupSpec"]
    if not head["template"]["spec"].get("containers"):
        errors.append("headGroupSpec should have at least one container")
    autoscaling = bool(cluster.get("enableInTreeAutoscaling"))
    groups = [("Head", head)] + [(g["groupName"], g) for g in cluster.get("workerGroupSpecs", [])]
    for group_name, group in groups:
        params = group.get("rayStartParams") or {}
        if any(params.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources")) and group.get("resources"):
            errors.append(f"resource fields should not be set in both rayStartParams and Resources for {group_name}")
        if "labels" in params:
            errors.append(f"rayStartParams['labels'] is not supported for {group_name} group")
        if group is head:
            continue
        if not group["template"]["spec"].get("containers"):
            errors.append("workerGroupSpec should have at least one container")
        low, high = group.get("minReplicas"), group.get("maxReplicas")
        if not autoscaling and (low is None or high is None):
            errors.append(f"worker group {group_name} must set both minReplicas and maxReplicas")
        if low is not None and low < 0 or high is not None and high < 0:
            errors.append(f"worker group {group_name} has negative replicas")
        if low is not None and high is not None and low > high:
            errors.append(f"worker group {group_name} has minReplicas {low} greater than maxReplicas {high}")
        if group.get("suspend") and autoscaling:
            errors.append(f"worker group {group_name} cannot be suspended with Autoscaler enabled")
    head_env = {e["name"] for e in head["template"]["spec"]["containers"][0].get("env", [])}
    gcs_ft = (
        cluster.get("gcsFaultToleranceOptions") is not None
        or (meta.get("annotations") or {}).get(GCS_FT_ANNOTATION) == "true"
    )
    if (meta.get("annotations") or {}).get(GCS_FT_ANNOTATION) and cluster.get("gcsFaultToleranceOptions"):
        errors.append("ray.io/ft-enabled annotation and GcsFaultToleranceOptions are both set")
    if not gcs_ft:
        if "RAY_REDIS_ADDRESS" in head_env:
            errors.append("RAY_REDIS_ADDRESS is set which implicitly enables GCS fault tolerance")
        if "REDIS_PASSWORD" in head_env or "redis-password" in (head.get("rayStartParams") or {}):
            errors.append("cannot set a Redis password when GCS fault tolerance is disabled")
    if ((head.get("headService") or {}).get("metadata") or {}).get("name"):
        errors.append("spec.rayClusterConfig.headGroupSpec.headService.metadata.name should not be set")
    upgrade = spec.get("upgradeStrategy") or {}
    if upgrade.get("type") is not None and upgrade["type"] not in UPGRADE_TYPES:
        errors.append(f"Spec.UpgradeStrategy.Type value {upgrade['type']} is invalid")
    if spec.get("rayClusterDeletionDelaySeconds", 0) < 0:
        errors.append("Spec.RayClusterDeletionDelaySeconds should be a non-negative integer")
    if upgrade.get("type") == "NewClusterWithIncrementalUpgrade":
        options = upgrade.get("clusterUpgradeOptions")
        if not autoscaling:
            errors.append("Ray Autoscaler is required for NewClusterWithIncrementalUpgrade")
        if options is None:
            errors.append("ClusterUpgradeOptions are required for NewClusterWithIncrementalUpgrade")
        else:
            surge, step = options.get("maxSurgePercent", 100), options.get("stepSizePercent")
            if not 0 <= surge <= 100:
                errors.append("maxSurgePercent must be between 0 and 100")
            if step is None or not 0 <= step <= 100:
                errors.append("stepSizePercent must be between 0 and 100")
            elif step > surge:
                errors.append("stepSizePercent must be less than or equal to maxSurgePercent")
            if not options.get("intervalSeconds", 0) > 0:
                errors.append("intervalSeconds must be greater than 0")
            if not options.get("gatewayClassName"):
                errors.append("gatewayClassName is required for NewClusterWithIncrementalUpgrade")
    return errors


# -- the tests ------------------------------------------------------------------------


def test_every_rendered_file_is_what_the_serve_configs_render_now():
    assert kuberay.main(["--check"]) == 0, "deploy/kuberay/ is out of date: run python -m cluster.kuberay"


def test_a_changed_config_makes_the_check_fail(tmp_path, monkeypatch):
    config = yaml.safe_load(kuberay.VARIANTS["gpu"].config.read_text())
    config["applications"][0]["args"]["models"][0]["autoscaling"]["max_replicas"] = 99
    changed = tmp_path / "gpu.yaml"
    changed.write_text(yaml.safe_dump(config))
    monkeypatch.setitem(
        kuberay.VARIANTS, "gpu", kuberay.Variant(**{**vars(kuberay.VARIANTS["gpu"]), "config": changed})
    )
    assert kuberay.main(["--check"]) == 1


@pytest.mark.parametrize("variant", sorted(kuberay.VARIANTS))
def test_what_kustomize_builds_is_valid_against_kuberays_crd_and_kubernetes_schemas(variant, rayservice_schema):
    docs = built(variant)
    kinds = [doc["kind"] for doc in docs]  # kustomize's legacy order
    assert kinds == ["ConfigMap", "PersistentVolumeClaim", "PodMonitor", "NetworkPolicy", "RayService"], kinds
    validate_built(docs, rayservice_schema)
    [claim] = [doc for doc in docs if doc["kind"] == "PersistentVolumeClaim"]
    assert claim["metadata"]["name"] == kuberay.SHARED_CLAIM and claim["spec"]["accessModes"] == ["ReadWriteMany"]
    [dashboards] = [doc for doc in docs if doc["kind"] == "ConfigMap"]
    shipped = {board.name for board in kuberay.DASHBOARDS.glob("*.json")}
    assert set(dashboards["data"]) == shipped and all(json.loads(v) for v in dashboards["data"].values())


def test_the_schema_refuses_an_unknown_field(rayservice_schema):
    service = rayservice_of("gpu")
    service["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParms"] = {}  # a typo
    with pytest.raises(jsonschema.ValidationError, match="rayStartParms"):
        jsonschema.validate(service, rayservice_schema)
    service = rayservice_of("gpu")
    service["spec"]["serveConfig"] = "applications: []"  # a field of another version
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(service, rayservice_schema)


UNKNOWN_FIELDS = {  # a file a variant's build takes in -> a typo made in it
    "cpu/rayservice.yaml": ("rayStartParms", lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"]),
    "common/networkpolicy.yaml": ("ingres", lambda d: d["spec"]),
    "common/sharedvolume.yaml": ("accessMode", lambda d: d["spec"]),
}


@pytest.mark.parametrize("file", sorted(UNKNOWN_FIELDS))
def test_a_built_manifest_with_an_unknown_field_is_refused(file, tmp_path, rayservice_schema):
    deploy = tmp_path / "kuberay"
    shutil.copytree(kuberay.DEPLOY, deploy)
    validate_built(built("cpu", deploy), rayservice_schema)  # the copy as it is passes
    typo, where = UNKNOWN_FIELDS[file]
    doc = yaml.safe_load((deploy / file).read_text())
    where(doc)[typo] = {}
    (deploy / file).write_text(yaml.safe_dump(doc))
    with pytest.raises(jsonschema.ValidationError, match=f"'{typo}' was unexpected"):
        validate_built(built("cpu", deploy), rayservice_schema)


# A kustomization with every feature cluster/kustomize.py implements: a base in another
# directory (kustomization.yml), multi-document files with an empty document, kinds of
# kustomize's fixed order and others, namespaced and not, two generators.
def manifests(rows: list[tuple[str, str, str, str]]) -> str:
    """A YAML stream of one bare manifest per (apiVersion, kind, namespace or "", name)."""
    return "\n---\n".join(
        f"apiVersion: {api}\nkind: {kind}\nmetadata: {{name: {name}{', namespace: ' + ns if ns else ''}}}"
        for api, kind, ns, name in rows
    )


FEATURES = {
    "app/kustomization.yaml": """
resources:
  - ../base
  - web.yaml
configMapGenerator:
  - name: app-files
    files: [files/b.txt, files/a.conf]
generatorOptions:
  disableNameSuffixHash: true
""",
    "app/files/a.conf": "no newline at the end",
    "app/files/b.txt": "two\nlines\n",
    "app/web.yaml": manifests(
        [
            ("apps/v1", "Deployment", "apps", "web"),
            ("v1", "Service", "apps", "web"),
            ("admissionregistration.k8s.io/v1", "ValidatingWebhookConfiguration", "", "check"),
            ("apiextensions.k8s.io/v1", "CustomResourceDefinition", "", "widgets.example.com"),
            ("ray.io/v1", "RayService", "", "serve"),
            ("monitoring.coreos.com/v1", "PodMonitor", "", "serve"),
            ("v1", "Namespace", "", "apps"),
        ]
    )
    + "\n---\n",
    "base/kustomization.yml": """
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [things.yaml]
configMapGenerator:
  - name: base-config
    files: [things.yaml]
    options:
      labels: {tier: base}
generatorOptions: {disableNameSuffixHash: true}
""",
    "base/things.yaml": manifests(
        [
            ("rbac.authorization.k8s.io/v1", "ClusterRole", "", "reader"),
            ("rbac.authorization.k8s.io/v1", "Role", "apps", "reader"),
            ("v1", "ServiceAccount", "apps", "runner"),
            ("v1", "Secret", "apps", "keys"),
            ("v1", "ConfigMap", "apps", "zeta"),
            ("v1", "ConfigMap", "", "alpha"),
            ("example.com/v2", "Widget", "", "w"),
            ("example.com/v1", "Widget", "", "w"),
            ("apps/v1", "Deployment", "a", "web"),
            ("admissionregistration.k8s.io/v1", "MutatingWebhookConfiguration", "", "mutate"),
        ]
    ),
}
FEATURES_ORDER = [  # what kubectl kustomize (v1.32, kustomize v5.5) gives, in its order
    ("Namespace", "", "apps"),
    ("CustomResourceDefinition", "", "widgets.example.com"),
    ("ServiceAccount", "apps", "runner"),
    ("Role", "apps", "reader"),
    ("ClusterRole", "", "reader"),
    ("ConfigMap", "apps", "zeta"),
    ("ConfigMap", "", "alpha"),
    ("ConfigMap", "", "app-files"),
    ("ConfigMap", "", "base-config"),
    ("Secret", "apps", "keys"),
    ("Service", "apps", "web"),
    ("Deployment", "apps", "web"),
    ("Deployment", "a", "web"),
    ("Widget", "", "w"),  # example.com/v1
    ("Widget", "", "w"),  # example.com/v2
    ("PodMonitor", "", "serve"),
    ("RayService", "", "serve"),
    ("MutatingWebhookConfiguration", "", "mutate"),
    ("ValidatingWebhookConfiguration", "", "check"),
]


def test_the_python_build_implements_kustomizes_resources_generators_and_order(tmp_path):
    docs = kustomize.build(write_tree(tmp_path, FEATURES) / "app")
    assert [(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]) for d in docs] == FEATURES_ORDER
    assert [d["apiVersion"] for d in docs if d["kind"] == "Widget"] == ["example.com/v1", "example.com/v2"]
    configs = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    assert configs["app-files"] == {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "app-files"},
        "data": {"a.conf": "no newline at the end", "b.txt": "two\nlines\n"},
    }
    assert configs["base-config"]["metadata"] == {"name": "base-config", "labels": {"tier": "base"}}
    assert configs["base-config"]["data"] == {"things.yaml": FEATURES["base/things.yaml"]}


@pytest.mark.parametrize("tree", [*sorted(kuberay.VARIANTS), "features"])
def test_the_python_build_is_what_kubectl_kustomize_builds(tree, tmp_path):
    directory = kuberay.DEPLOY / tree if tree in kuberay.VARIANTS else write_tree(tmp_path, FEATURES) / "app"
    assert kustomize.build(directory) == kubectl_kustomize(directory)


GENERATED = "configMapGenerator: [{name: c, files: [c.txt]}]\n"
NO_HASH = "generatorOptions: {disableNameSuffixHash: true}\n"
CONFIG_MAP = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n"
UNSUPPORTED = {  # a kustomization (files under tmp_path; "k" is its directory) -> what the refusal names
    "namespace": ({"k/kustomization.yaml": "namespace: apps\n"}, "namespace"),
    "patches": ({"k/kustomization.yaml": "patches: [{path: p.yaml}]\n"}, "patches"),
    "images": ({"k/kustomization.yaml": "images: [{name: a, newTag: b}]\n"}, "images"),
    "labels": ({"k/kustomization.yaml": "labels: [{pairs: {a: b}}]\n"}, "labels"),
    "a Component": ({"k/kustomization.yaml": "kind: Component\n"}, "Component"),
    "two kustomization files": ({"k/kustomization.yaml": "", "k/kustomization.yml": ""}, "2 kustomization files"),
    "no kustomization": ({"k/kustomization.yaml": "resources: [../b]\n", "b/x.yaml": CONFIG_MAP}, "0 kustomization"),
    "a remote resource": ({"k/kustomization.yaml": "resources: [https://example.com/x.yaml]\n"}, "not a local"),
    "a missing resource": ({"k/kustomization.yaml": "resources: [x.yaml]\n"}, "neither a file"),
    "a file outside": ({"k/kustomization.yaml": "resources: [../x.yaml]\n", "x.yaml": CONFIG_MAP}, "outside"),
    "a cycle": (
        {"k/kustomization.yaml": "resources: [../b]\n", "b/kustomization.yaml": "resources: [../k]\n"},
        "cycle",
    ),
    "one id twice": (
        {"k/kustomization.yaml": "resources: [x.yaml, y.yaml]\n", "k/x.yaml": CONFIG_MAP, "k/y.yaml": CONFIG_MAP},
        "one id",
    ),
    "one id in default and none": (
        {
            "k/kustomization.yaml": "resources: [x.yaml, y.yaml]\n",
            "k/x.yaml": CONFIG_MAP,
            "k/y.yaml": CONFIG_MAP.replace("c}", "c, namespace: default}"),
        },
        "one id",
    ),
    "a List": (
        {"k/kustomization.yaml": "resources: [x.yaml]\n", "k/x.yaml": "apiVersion: v1\nkind: List\nitems: []\n"},
        "List",
    ),
    "no name": (
        {"k/kustomization.yaml": "resources: [x.yaml]\n", "k/x.yaml": "apiVersion: v1\nkind: ConfigMap\n"},
        "metadata.name",
    ),
    "a key twice": (
        {"k/kustomization.yaml": "resources: [x.yaml]\n", "k/x.yaml": CONFIG_MAP + "data: {a: 1, a: 2}\n"},
        "twice",
    ),
    "kustomize's annotation": (
        {
            "k/kustomization.yaml": "resources: [x.yaml]\n",
            "k/x.yaml": CONFIG_MAP.replace("c}", "c, annotations: {config.kubernetes.io/index: '0'}}"),
        },
        "config.kubernetes.io/index",
    ),
    "the name hash": ({"k/kustomization.yaml": GENERATED, "k/c.txt": "x"}, "name hash"),
    "generator literals": (
        {"k/kustomization.yaml": NO_HASH + "configMapGenerator: [{name: c, literals: [a=b]}]\n"},
        "literals",
    ),
    "generator behavior": (
        {"k/kustomization.yaml": NO_HASH + GENERATED.replace("name: c", "name: c, behavior: merge"), "k/c.txt": "x"},
        "behavior",
    ),
    "a generator's key=path": (
        {"k/kustomization.yaml": NO_HASH + GENERATED.replace("[c.txt]", "[k=c.txt]"), "k/c.txt": "x"},
        "plain path",
    ),
    "a generator's annotations": (
        {
            "k/kustomization.yaml": NO_HASH + GENERATED.replace("}]", ", options: {annotations: {a: b}}}]"),
            "k/c.txt": "x",
        },
        "options",
    ),
    "generatorOptions' labels": (
        {"k/kustomization.yaml": NO_HASH.replace("}", ", labels: {a: b}}") + GENERATED, "k/c.txt": "x"},
        "generatorOptions",
    ),
    "a generator's file outside": (
        {"k/kustomization.yaml": NO_HASH + GENERATED.replace("c.txt", "../c.txt"), "c.txt": "x"},
        "not a file in",
    ),
    "binary data": ({"k/kustomization.yaml": NO_HASH + GENERATED, "k/c.txt": ""}, "binaryData"),
    "a generator's name twice": (
        {"k/kustomization.yaml": NO_HASH + GENERATED + "resources: [x.yaml]\n", "k/c.txt": "x", "k/x.yaml": CONFIG_MAP},
        "one id",
    ),
}


@pytest.mark.parametrize("how", sorted(UNSUPPORTED))
def test_a_kustomize_feature_the_python_build_lacks_is_refused(how, tmp_path):
    files, named = UNSUPPORTED[how]
    write_tree(tmp_path, files)
    if how == "binary data":
        (tmp_path / "k" / "c.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(kustomize.Unsupported, match=re.escape(named)):
        kustomize.build(tmp_path / "k")


@pytest.mark.parametrize("variant", sorted(kuberay.VARIANTS))
def test_the_serve_config_is_a_valid_serve_deploy_config_whose_applications_build(variant):
    from ray._common.utils import import_attr
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load(rayservice_of(variant)["spec"]["serveConfigV2"])
    assert config == kuberay.serve_config_v2(yaml.safe_load(kuberay.VARIANTS[variant].config.read_text()))
    ServeDeploySchema.model_validate(config)
    assert config["http_options"]["host"] == "0.0.0.0"
    for app in config["applications"]:
        application = import_attr(app["import_path"])(app.get("args", {}))
        assert type(application).__name__ == "Application", app["name"]


@pytest.mark.parametrize("variant", sorted(kuberay.VARIANTS))
def test_kuberays_admission_rules_accept_each_variant(variant):
    assert kuberay_refusals(rayservice_of(variant)) == []


def _broken(change) -> dict:
    service = copy.deepcopy(rayservice_of("gpu"))
    change(service)
    return service


BROKEN = {
    "name too long": lambda s: s["metadata"].update(name="x" * 48),
    "name not DNS1035": lambda s: s["metadata"].update(name="LLM_cluster"),
    "resources twice": lambda s: s["spec"]["rayClusterConfig"]["headGroupSpec"].update(resources={"CPU": "1"}),
    "labels in rayStartParams": lambda s: s["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["rayStartParams"].update(
        labels="a=b"
    ),
    "min above max": lambda s: s["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(
        minReplicas=9, maxReplicas=1
    ),
    "head service named": lambda s: s["spec"]["rayClusterConfig"]["headGroupSpec"].update(
        headService={"metadata": {"name": "mine"}}
    ),
    "upgrade type unknown": lambda s: s["spec"]["upgradeStrategy"].update(type="BlueGreen"),
    "incremental without autoscaler": lambda s: s["spec"]["rayClusterConfig"].update(enableInTreeAutoscaling=False),
    "step above surge": lambda s: s["spec"]["upgradeStrategy"]["clusterUpgradeOptions"].update(stepSizePercent=50),
    "no gateway class": lambda s: s["spec"]["upgradeStrategy"]["clusterUpgradeOptions"].pop("gatewayClassName"),
    "GCS Redis without fault tolerance": lambda s: s["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"][
        "containers"
    ][0]["env"].append({"name": "RAY_REDIS_ADDRESS", "value": "redis:6379"}),
}


@pytest.mark.parametrize("how", sorted(BROKEN))
def test_each_ported_rule_refuses_a_manifest_broken_its_way(how):
    assert kuberay_refusals(_broken(BROKEN[how])), how


def test_secrets_come_from_the_secret_and_a_config_holding_one_is_refused():
    for variant in kuberay.VARIANTS:
        service = rayservice_of(variant)
        for container in containers(service):
            from_secret = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
            assert from_secret == {
                name: {"name": kuberay.SECRET, "key": key} for name, key in kuberay.SECRET_ENV.items()
            }
        assert (
            "redis://" not in service["spec"]["serveConfigV2"] and "admin_token" not in service["spec"]["serveConfigV2"]
        )
    config = yaml.safe_load(kuberay.VARIANTS["cpu"].config.read_text())
    config["applications"][0]["args"]["redis_url"] = "redis://:hunter2@redis:6379/0"
    with pytest.raises(ValueError, match="redis_url"):
        kuberay.serve_config_v2(config)


def test_the_ray_serve_settings_are_the_makefiles_and_the_images():
    makefile = dict(re.findall(r"^export (RAY_SERVE_\w+) \?= (\S+)", (ROOT / "Makefile").read_text(), re.M))
    dockerfile = dict(re.findall(r"(RAY_SERVE_\w+)=(\S+?)(?: \\)?$", (ROOT / "docker/Dockerfile").read_text(), re.M))
    assert dockerfile == kuberay.SERVE_ENV
    assert {k: v for k, v in makefile.items() if k != "RAY_SERVE_HAPROXY_BINARY_PATH"} == {
        k: v for k, v in kuberay.SERVE_ENV.items() if k != "RAY_SERVE_HAPROXY_BINARY_PATH"
    }
    for variant in kuberay.VARIANTS:
        for container in containers(rayservice_of(variant)):
            plain = {e["name"]: e["value"] for e in container["env"] if "value" in e}
            assert plain == {**kuberay.SERVE_ENV, **kuberay.SHARED_ENV}
            assert {"name": "shared", "mountPath": kuberay.SHARED_MOUNT} in container["volumeMounts"]


def test_gpu_groups_hold_what_their_models_need():
    service = rayservice_of("gpu")
    groups = {g["groupName"]: g for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    models = kuberay.models_of(yaml.safe_load(kuberay.VARIANTS["gpu"].config.read_text()))
    for model in models:
        group = groups[f"gpu-{model.accelerator_type.lower()}"]
        [container] = group["template"]["spec"]["containers"]
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        assert container["resources"]["requests"]["nvidia.com/gpu"] == str(gpus)
        assert gpus >= model.tensor_parallel_size and gpus % model.tensor_parallel_size == 0, model.name
        product = kuberay.ACCELERATORS[model.accelerator_type][0]
        assert group["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": product}
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # no model replica on the head
    assert "nvidia.com/gpu" not in json.dumps(head)


@pytest.mark.parametrize("variant", sorted(kuberay.VARIANTS))
def test_the_gateway_reads_the_secret_and_the_shared_volume_from_the_pods_environment(variant, monkeypatch):
    from serve_app.settings import AppSettings

    service = rayservice_of(variant)
    [main] = [a for a in yaml.safe_load(service["spec"]["serveConfigV2"])["applications"] if a["name"] == "llm"]
    for name, value in {**kuberay.SHARED_ENV, "REDIS_URL": "redis://redis.example:6379/0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LLM_CLUSTER_ADMIN_TOKEN", "from-the-secret-of-32-characters-or-more")
    settings = AppSettings(**main["args"])
    assert settings.batch.files_dir == kuberay.SHARED_ENV["LLM_CLUSTER_BATCH__FILES_DIR"]
    assert settings.records.sink_dir == kuberay.SHARED_ENV["LLM_CLUSTER_RECORDS__SINK_DIR"]
    assert settings.redis_url == "redis://redis.example:6379/0"
    assert (
        settings.admin_token is not None
        and settings.admin_token.get_secret_value() == "from-the-secret-of-32-characters-or-more"
    )
