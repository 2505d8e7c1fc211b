"""cluster.yaml, checked the way `ray up` checks it before it touches the cloud
(Ray's prepare_config + validate_config: defaults merged, JSON schema, node types),
and against the Serve config it deploys (configs/gpu.yaml)."""

from copy import deepcopy
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from serve_app.settings import AppSettings

REPO = Path(__file__).resolve().parents[2]


def load(name):
    return yaml.safe_load((REPO / name).read_text())


@pytest.fixture(scope="module")
def cluster():
    return load("cluster.yaml")


def ray_up_checks(config):
    prepared = prepare_config(deepcopy(config))
    validate_config(prepared)
    return prepared


def test_cluster_yaml_passes_rays_own_validation(cluster):
    prepared = ray_up_checks(cluster)
    assert prepared["provider"]["type"] == "aws"
    assert prepared["head_node_type"] == "head"


def test_validation_would_catch_a_broken_config(cluster):
    broken = deepcopy(cluster)
    broken["available_node_types"]["gpu-l4"]["min_wokers"] = 0  # a typo
    with pytest.raises(jsonschema.ValidationError):
        ray_up_checks(broken)
    too_small = deepcopy(cluster)
    too_small["available_node_types"]["gpu-l4"]["min_workers"] = too_small["max_workers"] + 1
    with pytest.raises(ValueError):
        ray_up_checks(too_small)


def test_head_is_cpu_only_and_gpu_types_scale_from_zero(cluster):
    types = cluster["available_node_types"]
    assert types["head"]["resources"]["CPU"] == 0
    gpu_types = {name: spec for name, spec in types.items() if spec["resources"].get("GPU")}
    assert {"gpu-l4", "gpu-h100", "gpu-a100"} <= set(gpu_types)
    assert all(spec["min_workers"] == 0 for spec in gpu_types.values())
    assert cluster["docker"]["image"] and "--gpus all" in cluster["docker"]["worker_run_options"]


def test_every_node_gets_redis_url_and_the_head_deploys_the_app(cluster):
    for commands in (cluster["head_start_ray_commands"], cluster["worker_start_ray_commands"]):
        start = next(command for command in commands if "ray start" in command)
        assert "export REDIS_URL=" in start and start.index("export REDIS_URL=") < start.index("ray start")
    deploy = cluster["head_start_ray_commands"][-1]
    assert deploy.startswith("serve deploy ") and deploy.endswith("configs/gpu.yaml")
    assert any(source == "./configs" for source in cluster["file_mounts"].values())


def test_the_deployed_models_fit_the_node_types(cluster):
    settings = AppSettings(**load("configs/gpu.yaml")["applications"][0]["args"])
    types = cluster["available_node_types"]
    ingress = settings.ingress.deployment["ray_actor_options"]
    assert set(ingress["resources"]) <= set(types["head"]["resources"])
    for model in settings.models:
        assert model.accelerator == "gpu"
        offering = [
            spec for spec in types.values()
            if spec["resources"].get(f"accelerator_type:{model.accelerator_type}", 0) >= model.tensor_parallel_size
        ]
        assert offering, f"no node type offers {model.tensor_parallel_size}x {model.accelerator_type} for {model.name}"
        cpus = max(spec["resources"]["CPU"] for spec in offering)
        assert model.cpus_per_replica <= cpus
