"""cluster.yaml, checked the way `ray up` checks it before it touches the cloud
(Ray's prepare_config + validate_config: defaults merged, JSON schema, node types),
and against the Serve config it deploys (configs/gpu.yaml)."""

import json
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
    check, deploy = cluster["head_start_ray_commands"][-1].split(" && ")
    assert check.startswith("llmctl check-config ") and check.endswith("configs/gpu.yaml")
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
            spec
            for spec in types.values()
            if spec["resources"].get(f"accelerator_type:{model.accelerator_type}", 0) >= model.tensor_parallel_size
        ]
        assert offering, f"no node type offers {model.tensor_parallel_size}x {model.accelerator_type} for {model.name}"
        cpus = max(spec["resources"]["CPU"] for spec in offering)
        assert model.cpus_per_replica <= cpus


def test_the_deployed_config_serves_every_model_behind_its_direct_route_as_serve_deploy_reads_it():
    from ray.serve.schema import ServeDeploySchema

    from serve_app.app import direct_apps, direct_route_problems

    config = load("configs/gpu.yaml")  # YAML's merge key resolved, as `serve deploy` reads it
    ServeDeploySchema.model_validate(config)
    main, *direct = config["applications"]
    assert all(model["direct_route"] for model in main["args"]["models"])  # /v1 in one hop on the cluster too
    assert direct == direct_apps(main["args"])
    assert direct_route_problems(config) == []


def check_config(tmp_path, config, capsys):
    from serve_app.cli import main

    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return main(["check-config", str(path)]), capsys.readouterr().err


def test_check_config_refuses_a_direct_route_without_its_application_or_with_other_settings(tmp_path, capsys):
    shipped = load("configs/gpu.yaml")
    assert check_config(tmp_path, shipped, capsys) == (0, "")

    missing = deepcopy(shipped)
    del missing["applications"][2]  # `serve deploy` would leave llama-3.3-70b-instruct with no deployment
    rc, err = check_config(tmp_path, missing, capsys)
    assert rc == 1 and "'direct-llama-3.3-70b-instruct' is missing" in err and err.count("\n") == 1

    stale = json.loads(json.dumps(shipped))  # the main application's models edited, the direct routes' copies not
    stale["applications"][0]["args"]["models"][0]["engine_kwargs"]["max_model_len"] = 4096
    rc, err = check_config(tmp_path, stale, capsys)
    assert rc == 1 and err.count("args must be the args of application 'llm' plus direct_model") == 3

    moved = deepcopy(shipped)
    moved["applications"][3]["route_prefix"] = "/bge"
    rc, err = check_config(tmp_path, moved, capsys)
    assert rc == 1 and "'direct-bge-m3': route_prefix must be '/direct/bge-m3'" in err


def test_local_twin_passes_rays_validation_and_its_provider_adopts_this_machine(monkeypatch, tmp_path):
    from ray.autoscaler._private.providers import _get_node_provider
    from ray.autoscaler.tags import NODE_KIND_HEAD, TAG_RAY_LAUNCH_CONFIG, TAG_RAY_NODE_KIND

    local = ray_up_checks(load("cluster.local.yaml"))
    head = local["head_node_type"]
    assert local["available_node_types"][head]["resources"]["CPU"] < 1.5  # less than configs/multi.yaml needs
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in " ".join(local["head_start_ray_commands"])

    monkeypatch.setenv("RAY_FAKE_CLUSTER", "1")
    provider = _get_node_provider(local["provider"], local["cluster_name"], use_cache=False)
    [head_id] = provider.non_terminated_nodes({TAG_RAY_NODE_KIND: NODE_KIND_HEAD})
    provider.create_node({}, {TAG_RAY_NODE_KIND: NODE_KIND_HEAD, TAG_RAY_LAUNCH_CONFIG: "abc"}, 1)
    assert provider.non_terminated_nodes({TAG_RAY_NODE_KIND: NODE_KIND_HEAD}) == [head_id]
    assert provider.node_tags(head_id)[TAG_RAY_LAUNCH_CONFIG] == "abc"
    provider.terminate_node(head_id)  # forgotten (`ray down` ends its Ray with `ray stop`), not killed
    assert provider.non_terminated_nodes({}) == []
    provider.create_node({}, {TAG_RAY_NODE_KIND: NODE_KIND_HEAD}, 1)  # `ray up` adopts it again
    assert provider.non_terminated_nodes({TAG_RAY_NODE_KIND: NODE_KIND_HEAD}) == [head_id]

    runner = provider.get_command_runner("", head_id, {}, "c", None, True)
    # Values go JSON-encoded, as Ray's SSH runner sends them (e.g. RAY_OVERRIDE_RESOURCES).
    resources = runner.run("echo $RES", with_output=True, environment_variables={"RES": {"CPU": 1}})
    assert resources.strip() == '{"CPU":1}'
    (tmp_path / "a.yaml").write_text("x: 1")
    runner.run_rsync_up(str(tmp_path / "a.yaml"), str(tmp_path / "copied" / "a.yaml"))
    assert (tmp_path / "copied" / "a.yaml").read_text() == "x: 1"
    with pytest.raises(Exception, match="Command failed"):
        runner.run("exit 3")


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster.local.yaml"])
def test_the_ray_dashboard_never_listens_beyond_the_node(name):
    # Its Jobs API runs submitted code without authentication: 127.0.0.1 only.
    config = load(name)
    starts = [
        c
        for key in ("head_start_ray_commands", "worker_start_ray_commands")
        for c in config.get(key, [])
        if "ray start" in c
    ]
    assert starts
    for command in starts:
        assert "0.0.0.0" not in command, command
        if "--head" in command:
            assert "--dashboard-host=127.0.0.1" in command, command
