"""KubeRay ``RayService`` manifests rendered from the Serve configs `make run` and
`cluster.yaml` deploy, so a platform team on Kubernetes runs the same applications
with the same settings (docs/operating.md, "On Kubernetes (KubeRay)").

``python -m cluster.kuberay`` writes ``deploy/kuberay/<variant>/rayservice.yaml`` for
each variant (``cpu``: configs/local.yaml on vLLM's CPU build; ``gpu``:
configs/gpu.yaml) and the dashboards beside the kustomization that ships them;
``--check`` fails when a checked-in file differs from what the configs render
(tests/unit/test_kuberay.py runs it). ``python -m cluster.kuberay --config my.yaml
--variant gpu`` prints one for a config of one's own.

What a RayService gets from its Serve config:
- ``serveConfigV2``: the config itself, listening on every interface of the head
  (``http_options.host``; the port is the config's).
- Worker groups: the CPU variant one group sized by the models' CPUs; the GPU
  variant one group per ``accelerator_type``, each pod holding the GPUs one replica
  of its largest model needs (``tensor_parallel_size``: ``nvidia.com/gpu`` requests
  and limits), min and max pods from the models' autoscaling bounds, pinned to the
  GPU model by NVIDIA GPU feature discovery's ``nvidia.com/gpu.product`` label.
- The head: no CPUs for Ray (``num-cpus: 0``: model replicas never land there), and
  the ``gateway`` resource the ingress replicas ask for when they do, as cluster.yaml's.
- Every container: the Ray Serve settings the Makefile exports (``SERVE_ENV``:
  HAProxy through ``llm-haproxy``, throughput mode, the drain window, the edge
  router's body), the Redis URL and the admin token from a ``Secret`` (never a
  secret in a manifest: the renderer refuses a config that holds one), the shared
  volume the files and records go to (the one state outside Redis), and Ray's
  metrics on port 8080 for Prometheus.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from contract.model_config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "kuberay"
DASHBOARDS = ROOT / "dashboards" / "grafana"

RAY_VERSION = "2.60.0"  # docker/Dockerfile's RAY_VERSION
NAME = "llm-cluster"
SECRET = "llm-cluster-secrets"  # keys: redis-url, admin-token (docs/operating.md)
POD_LABELS = {"app.kubernetes.io/name": NAME}  # what the NetworkPolicy and PodMonitor select
SERVE_PORT = 8000
METRICS_PORT = 8080

# Ray Serve's high-throughput configuration, exactly as the Makefile exports it and
# docker/Dockerfile sets it (tests/unit/test_kuberay.py holds the three equal).
SERVE_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_HAPROXY_BINARY_PATH": "/home/ray/anaconda3/bin/llm-haproxy",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "5",
    "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",
    "RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE": "262144",
}
# Read from the Secret, by the application's settings (serve_app/settings.py).
SECRET_ENV = {"REDIS_URL": "redis-url", "LLM_CLUSTER_ADMIN_TOKEN": "admin-token"}
SECRET_ARGS = ("redis_url", "admin_token")  # what a manifest's serveConfigV2 may never hold

# The one state outside Redis, uploads and batch results (batch.files_dir) and final
# request records (records.sink_dir), on a volume every gateway pod shares, in both
# clusters during an upgrade: deploy/kuberay/common/sharedvolume.yaml's claim (ReadWriteMany).
SHARED_CLAIM = "llm-cluster-shared"
SHARED_MOUNT = "/mnt/llm-cluster"
SHARED_ENV = {
    "LLM_CLUSTER_BATCH__FILES_DIR": f"{SHARED_MOUNT}/files",
    "LLM_CLUSTER_RECORDS__SINK_DIR": f"{SHARED_MOUNT}/records",
}

# A GPU class → NVIDIA GPU feature discovery's product label and the host memory a pod
# gets per GPU (weights are staged in host memory while loading).
ACCELERATORS = {
    "L4": ("NVIDIA-L4", 32),
    "A10G": ("NVIDIA-A10G", 32),
    "A100": ("NVIDIA-A100-SXM4-80GB", 96),
    "H100": ("NVIDIA-H100-80GB-HBM3", 128),
}
CPUS_PER_GPU = 8  # a GPU node's vCPUs per GPU (g6, p4d, p5 and GKE's a2/a3 all have 8-24)
CPU_WORKER = {"cpu": 4, "memory_gi": 16}  # the CPU variant's worker pod


# Images: docker/Dockerfile's variants (VARIANT=cpu, gpu, cpu-vllm), one name each so a
# kustomize `images` entry moves one role to another registry or tag.
@dataclass(frozen=True)
class Variant:
    name: str
    config: Path
    head_image: str
    worker_image: str
    upgrade: dict[str, Any]


VARIANTS = {
    "cpu": Variant(
        "cpu",
        ROOT / "configs" / "local.yaml",
        f"ghcr.io/{NAME}/{NAME}-cpu-vllm:0.1.0",
        f"ghcr.io/{NAME}/{NAME}-cpu-vllm:0.1.0",
        # A second cluster the size of the first while it starts, then the swap: cheap
        # on CPUs, and needs no Gateway API in the cluster.
        {"type": "NewCluster"},
    ),
    "gpu": Variant(
        "gpu",
        ROOT / "configs" / "gpu.yaml",
        f"ghcr.io/{NAME}/{NAME}-cpu:0.1.0",  # cluster.yaml's head_image: the gateway, no CUDA
        f"ghcr.io/{NAME}/{NAME}-gpu:0.1.0",
        # GPUs are scarce: the new cluster grows and takes traffic a quarter at a time
        # (needs the RayServiceIncrementalUpgrade feature gate and a Gateway API class).
        {
            "type": "NewClusterWithIncrementalUpgrade",
            "clusterUpgradeOptions": {
                "gatewayClassName": "istio",
                "maxSurgePercent": 25,
                "stepSizePercent": 25,
                "intervalSeconds": 60,
            },
        },
    ),
}


def serve_config_v2(config: dict[str, Any]) -> dict[str, Any]:
    """The Serve config as the RayService carries it: the head listens on every
    interface; a config holding a secret is refused."""
    config = copy.deepcopy(config)
    for app in config.get("applications", []):
        held = [name for name in SECRET_ARGS if name in (app.get("args") or {})]
        if held:
            raise ValueError(f"application {app.get('name')!r} holds {held}: secrets come from the {SECRET} Secret")
    config.setdefault("http_options", {})["host"] = "0.0.0.0"
    config["http_options"].setdefault("port", SERVE_PORT)
    return config


def models_of(config: dict[str, Any]) -> list[ModelConfig]:
    """The main application's models (every direct application repeats them)."""
    for app in config["applications"]:
        if app["import_path"].endswith(":build_app"):
            return [ModelConfig(**model) for model in app["args"].get("models", [])]
    raise ValueError("the config has no application built by serve_app.app:build_app")


def _replicas(model: ModelConfig) -> tuple[int, int]:
    if model.autoscaling is not None:
        return model.autoscaling.min_replicas, model.autoscaling.max_replicas
    count = int(model.deployment.get("num_replicas", 1))
    return count, count


def _ingress_gateway_units(config: dict[str, Any]) -> int:
    """The ``gateway`` resource the head must offer: twice what the ingress replicas
    ask for (room for as many replacements during a rollout), 0 when they ask none."""
    for app in config["applications"]:
        if app["import_path"].endswith(":build_app"):
            deployment = app["args"].get("ingress", {}).get("deployment", {})
            asked = deployment.get("ray_actor_options", {}).get("resources", {}).get("gateway", 0)
            return int(math.ceil(2 * asked * deployment.get("num_replicas", 1)))
    return 0


def _env() -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": name, "value": value} for name, value in {**SERVE_ENV, **SHARED_ENV}.items()]
    env += [
        {"name": name, "valueFrom": {"secretKeyRef": {"name": SECRET, "key": key}}} for name, key in SECRET_ENV.items()
    ]
    return env


def _container(name: str, image: str, cpu: float, memory_gi: int, gpus: int = 0, head: bool = False) -> dict:
    requests: dict[str, Any] = {"cpu": str(cpu), "memory": f"{memory_gi}Gi"}
    limits: dict[str, Any] = {"memory": f"{memory_gi}Gi"}  # no CPU limit: throttling stalls streams
    if gpus:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(gpus)
    ports = [{"containerPort": METRICS_PORT, "name": "metrics"}]
    if head:
        ports = [
            {"containerPort": 6379, "name": "gcs-server"},
            {"containerPort": 8265, "name": "dashboard"},
            {"containerPort": 10001, "name": "client"},
            {"containerPort": SERVE_PORT, "name": "serve"},
            *ports,
        ]
    return {
        "name": name,
        "image": image,
        "env": _env(),
        "ports": ports,
        "resources": {"requests": requests, "limits": limits},
        # vLLM's workers share tensors through /dev/shm (cluster.yaml: --shm-size=16g).
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "shared", "mountPath": SHARED_MOUNT},
        ],
    }


def _pod(container: dict, node_selector: dict[str, str] | None = None) -> dict:
    spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
            {"name": "shared", "persistentVolumeClaim": {"claimName": SHARED_CLAIM}},
        ],
        # A replica drains its streams before it goes (Serve's graceful shutdown).
        "terminationGracePeriodSeconds": 120,
    }
    if node_selector:
        spec["nodeSelector"] = node_selector
    return {"metadata": {"labels": dict(POD_LABELS)}, "spec": spec}


def worker_groups(variant: Variant, models: list[ModelConfig]) -> list[dict[str, Any]]:
    """One group for the CPU models, one per GPU class."""
    groups = []
    on_cpu = [m for m in models if m.accelerator != "gpu"]
    if on_cpu:
        least = sum(m.cpus_per_replica * _replicas(m)[0] for m in on_cpu)
        most = sum(m.cpus_per_replica * _replicas(m)[1] for m in on_cpu)
        low = max(1, math.ceil(least / CPU_WORKER["cpu"]))
        groups.append(
            _group(
                "cpu",
                low,
                max(low, math.ceil(most / CPU_WORKER["cpu"])),
                _container("ray-worker", variant.worker_image, CPU_WORKER["cpu"], CPU_WORKER["memory_gi"]),
            )
        )
    by_class: dict[str, list[ModelConfig]] = {}
    for model in models:
        if model.accelerator == "gpu":
            by_class.setdefault(model.accelerator_type or "any", []).append(model)
    for gpu_class, members in sorted(by_class.items()):
        gpus = max(m.tensor_parallel_size for m in members)
        # Pods a bound needs: each replica takes tensor_parallel_size GPUs of a pod.
        fewest = sum(math.ceil(_replicas(m)[0] * m.tensor_parallel_size / gpus) for m in members)
        most_pods = sum(math.ceil(_replicas(m)[1] * m.tensor_parallel_size / gpus) for m in members)
        product, memory_per_gpu = ACCELERATORS.get(gpu_class, (None, 32))
        container = _container(
            "ray-worker", variant.worker_image, CPUS_PER_GPU * gpus, memory_per_gpu * gpus, gpus=gpus
        )
        selector = {"nvidia.com/gpu.product": product} if product else None
        groups.append(_group(f"gpu-{gpu_class.lower()}", fewest, max(fewest, most_pods), container, selector))
    return groups


def _group(name: str, low: int, high: int, container: dict, selector: dict | None = None) -> dict[str, Any]:
    return {
        "groupName": name,
        "replicas": low,
        "minReplicas": low,
        "maxReplicas": high,
        "rayStartParams": {"metrics-export-port": str(METRICS_PORT)},
        "template": _pod(container, selector),
    }


def rayservice(variant: Variant, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The RayService of ``config`` (default: the variant's shipped one)."""
    config = config if config is not None else yaml.safe_load(variant.config.read_text())
    models = models_of(config)
    head_params = {
        "num-cpus": "0",
        # KubeRay polls Serve's status through the dashboard; the NetworkPolicy keeps
        # it inside the cluster.
        "dashboard-host": "0.0.0.0",
        "metrics-export-port": str(METRICS_PORT),
    }
    gateway = _ingress_gateway_units(config)
    if gateway:
        head_params["resources"] = f'"{{\\"gateway\\": {gateway}}}"'
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": NAME, "labels": dict(POD_LABELS)},
        "spec": {
            "upgradeStrategy": copy.deepcopy(variant.upgrade),
            # The old cluster lives a minute past the swap: streams it still serves end.
            "rayClusterDeletionDelaySeconds": 120,
            "serveConfigV2": yaml.safe_dump(serve_config_v2(config), sort_keys=False),
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                "enableInTreeAutoscaling": True,
                "autoscalerOptions": {"idleTimeoutSeconds": 600},  # cluster.yaml's idle_timeout_minutes
                "headGroupSpec": {
                    "rayStartParams": head_params,
                    "template": _pod(_container("ray-head", variant.head_image, 4, 16, head=True)),
                },
                "workerGroupSpecs": worker_groups(variant, models),
            },
        },
    }


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def render(variant: Variant) -> str:
    header = (
        f"# Rendered by `python -m cluster.kuberay` from {_shown(variant.config)}: edit that\n"
        "# config (or deploy/kuberay/<variant>/kustomization.yaml), never this file.\n"
    )
    return header + yaml.safe_dump(rayservice(variant), sort_keys=False, width=120)


def files() -> dict[Path, bytes]:
    """Every generated file under deploy/kuberay/ and what it holds."""
    out = {DEPLOY / name / "rayservice.yaml": render(variant).encode() for name, variant in VARIANTS.items()}
    for board in sorted(DASHBOARDS.glob("*.json")):
        out[DEPLOY / "common" / "dashboards" / board.name] = board.read_bytes()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.kuberay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail when a checked-in file differs")
    parser.add_argument("--config", type=Path, help="print the RayService of this Serve config")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="gpu")
    args = parser.parse_args(argv)
    if args.config is not None:
        variant = VARIANTS[args.variant]
        sys.stdout.write(yaml.safe_dump(rayservice(variant, yaml.safe_load(args.config.read_text())), sort_keys=False))
        return 0
    stale = [path for path, body in files().items() if not path.exists() or path.read_bytes() != body]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is out of date: run python -m cluster.kuberay", file=sys.stderr)
        return 1 if stale else 0
    (DEPLOY / "common" / "dashboards").mkdir(parents=True, exist_ok=True)
    for path, body in files().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
    for old in (DEPLOY / "common" / "dashboards").glob("*.json"):
        if not (DASHBOARDS / old.name).exists():
            old.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
