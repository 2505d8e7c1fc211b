"""The GPU path, rehearsed on this CPU box (no GPU has ever run it here): Ray started
with logical GPUs and an accelerator type, models with ``accelerator: gpu`` deployed
through the same config -> Serve path as the application (``serve_app.app
.model_deployment``) with the recording engine in the engine seam
(``engine: replicas.rehearsal:start_recording``), and what vLLM on a GPU node would
get asserted from inside each replica: its placement group and bundles, its resources
and visible devices, the executor vLLM chooses there, its engine arguments and
environment. What the CPU build cannot show (its executor for one rank is ``mp``,
CUDA's ``uni``; CUDA's own device count) is named where it is asserted."""

from __future__ import annotations

import pytest
from stack import call_replica, start_ray, stop_serve_and_ray, wait_for_no_ray

from contract.model_config import RECORDING_ENGINE, ModelConfig
from replicas.sources import resolve_source
from serve_app.app import TRANSPORT_ENV, model_deployment

H100 = "accelerator_type:H100"


def gpu_model(name: str, tensor_parallel_size: int) -> ModelConfig:
    return ModelConfig(
        name=name,
        accelerator="gpu",
        accelerator_type="H100",
        engine=RECORDING_ENGINE,
        cpus_per_replica=0.5,
        engine_kwargs={"tensor_parallel_size": tensor_parallel_size, "max_model_len": 512},
    )


MODELS = {"gpu-one": gpu_model("gpu-one", 1), "gpu-two": gpu_model("gpu-two", 2)}


def holding(model_app):
    """An application whose ingress holds the model's deployment, as the gateway's
    ingress does (Serve's HAProxy mode refuses a custom request router on an ingress)."""
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Holder:
        def __init__(self, model):
            self.model = model

    return Holder.bind(model_app)


@pytest.fixture(scope="module")
def facts():
    from ray import serve

    wait_for_no_ray()
    # Three logical GPUs of one type: a replica of one GPU, and one of tensor parallelism 2.
    start_ray(
        num_cpus=4,
        num_gpus=3,
        resources={H100: 1},
        include_dashboard=False,
        log_to_driver=False,
        logging_level="WARNING",
    )
    try:
        serve.start()
        for name, model in MODELS.items():
            serve.run(holding(model_deployment(model)), name=name, route_prefix=None)
        yield {name: call_replica(name, "engine_facts", app_name=name) for name in MODELS}
    finally:
        stop_serve_and_ray()


def test_a_one_gpu_replica_holds_one_gpu_of_its_type_and_sees_only_it(facts):
    one = facts["gpu-one"]
    assert one["placement_group_bundles"] is None  # the replica actor itself holds the GPU
    assert one["assigned_resources"]["GPU"] == 1 and one["assigned_resources"][H100] == pytest.approx(0.001)
    [gpu] = one["accelerator_ids"]["GPU"]
    assert one["cuda_visible_devices"] == gpu  # Ray's CUDA_VISIBLE_DEVICES: the engine's rank 0 uses it
    assert one["tensor_parallel_size"] == one["world_size"] == 1
    # One rank runs in the engine's own process: vLLM's CUDA platform says "uni"; the CPU build, "mp".
    assert one["executor_backend"] in ("uni", "mp")


def test_a_tensor_parallel_replica_gets_a_packed_group_one_gpu_per_rank_and_vllms_ray_executor(facts):
    two = facts["gpu-two"]
    # Bundle 0 is the replica (CPU only); one GPU bundle of the type per rank, all on one node.
    assert two["placement_group_bundles"] == [{"CPU": 0.5}, {"GPU": 1.0, H100: 0.001}, {"GPU": 1.0, H100: 0.001}]
    assert "GPU" not in two["assigned_resources"]
    # Ray leaves CUDA_VISIBLE_DEVICES alone for a replica with no GPU: on a GPU node it sees
    # them all, which vLLM's device count (>= tensor_parallel_size) asks for.
    assert two["cuda_visible_devices"] is None
    assert two["tensor_parallel_size"] == two["world_size"] == 2
    # In a placement group vLLM runs its ranks as Ray workers in the group's GPU bundles.
    assert two["executor_backend"] == "ray"


def test_the_engine_gets_the_models_arguments_and_the_gateways_environment(facts):
    for name, seen in facts.items():
        assert seen["model"] == resolve_source(MODELS[name])
        assert name in (
            seen["served_model_name"] if isinstance(seen["served_model_name"], list) else [seen["served_model_name"]]
        )
        assert seen["max_model_len"] == 512
        assert seen["env"]["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0"  # vLLM fetches no redirect
        for key, value in TRANSPORT_ENV.items():  # Serve's replica gRPC limit, as every gateway deployment
            assert seen["env"][key] == value
        assert seen["engine"] == "recording (not started)"
