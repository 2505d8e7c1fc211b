"""The direct route's pure parts: the in-process handle the gateway calls the
replica through, and the application builders. (The route itself, with Redis,
Serve, HAProxy and vLLM: tests/e2e/direct_route_stack/test_2_direct_route_e2e.py.)"""

import asyncio
from types import SimpleNamespace

import pytest
import yaml
from ray.serve.exceptions import RequestCancelledError

from contract.replica_wire import ReplicaAnswer, StreamStart
from serve_app.app import build_app, build_direct_app, direct_apps
from serve_app.http.direct import DIRECT_ROUTES, InProcessReplica, direct_app
from serve_app.pipeline.replica_calls import QueueTimeout, only_item, reach_replica

SHIPPED = yaml.safe_load(open("configs/local.yaml"))["applications"][0]["args"]
# The same models without their direct routes: every model behind the ingress.
LOCAL = {**SHIPPED, "models": [{k: v for k, v in model.items() if k != "direct_route"} for model in SHIPPED["models"]]}


class Replica:
    """Records what it was asked; streams until told to stop."""

    def __init__(self):
        self.config = SimpleNamespace(name="tiny-llama")
        self.calls, self.stream_ended = [], None

    async def call(self, operation, body, adapter=None):
        self.calls.append((operation, body, adapter))
        return ReplicaAnswer(b"{}", None, "r1")

    async def call_streamed(self, operation, body, adapter=None, trace=None, prompt_allowance=None):  # as VLLMReplica's
        yield await self.call(operation, body, adapter)

    async def stream(self, operation, body, adapter=None, trace=None, prompt_allowance=None):
        self.calls.append((operation, body, adapter))
        try:
            yield StreamStart("r1", "data: 0\n\n")
            for i in range(1, 1000):
                await asyncio.sleep(0)
                yield f"data: {i}\n\n"
            self.stream_ended = "drained"
        except GeneratorExit:
            self.stream_ended = "closed"  # where vLLM aborts the request
            raise

    def model_info(self):
        return {"max_model_len": 2048, "operations": ["chat"]}


def test_a_unary_call_reaches_the_replica_with_its_adapter():
    replica = Replica()
    handle = InProcessReplica(replica)

    async def run():
        response = await reach_replica(
            lambda: handle.options(multiplexed_model_id="a1").call_streamed.remote("chat", {}), 1
        )
        return [item async for item in response]

    [answer] = asyncio.run(run())
    assert answer.replica == "r1"
    assert replica.calls == [("chat", {}, "a1")]
    assert handle.deployment_name == "model-tiny-llama"


def test_a_stream_is_relayed_item_by_item_and_cancel_ends_the_replicas_generator():
    replica = Replica()

    async def run():
        chunks = InProcessReplica(replica).options(stream=True).stream.remote("chat", {})
        await chunks._fetch_future_result_async()
        first = await chunks.__anext__()
        second = await chunks.__anext__()
        chunks.cancel()  # the client left
        for _ in range(3):
            await asyncio.sleep(0)
        return first, second

    first, second = asyncio.run(run())
    assert isinstance(first, StreamStart) and second == "data: 1\n\n"
    assert replica.stream_ended == "closed"


def test_a_call_withdrawn_before_it_ran_never_runs():
    replica = Replica()

    async def run():
        gate = asyncio.Event()  # the fair-share queue never opens: the call is never sent
        with pytest.raises(QueueTimeout):
            await reach_replica(lambda: InProcessReplica(replica).call_streamed.remote("chat", {}), 0.05, gate.wait)
        response = InProcessReplica(replica).call_streamed.remote("chat", {})
        response.cancel()  # sent, then withdrawn before read: closed, not left pending
        await asyncio.sleep(0)
        with pytest.raises(RequestCancelledError):  # as Serve's cancelled call answers
            await response.__anext__()

    asyncio.run(run())
    assert replica.calls == []


class SlowReplica(Replica):
    """A unary call that takes long (a 2,000-token answer): its one item never comes."""

    async def call_streamed(self, operation, body, adapter=None, trace=None, prompt_allowance=None):
        self.calls.append((operation, body, adapter))
        try:
            await asyncio.Event().wait()
            yield ReplicaAnswer(b"{}", None, "r1")
        except asyncio.CancelledError:
            self.stream_ended = "cancelled"  # where vLLM aborts the request
            raise


async def reading_a_unary_call(replica):
    """A unary call on ``replica`` and the task reading its one item, once it waits in the replica."""
    response = InProcessReplica(replica).call_streamed.remote("chat", {})
    reading = asyncio.ensure_future(only_item(response))
    for _ in range(3):
        await asyncio.sleep(0)
    assert not reading.done()
    return response, reading


def test_a_unary_call_cancelled_while_it_runs_ends_with_serves_cancel_error_and_ends_the_replicas_call():
    """A key revoked while its unary call runs (Gateway._call_unary's on_revoke): the
    in-process call ends as a Serve call does, with RequestCancelledError, which the
    gateway answers 401 charged the prompt; the replica's generator is cancelled where
    it waits. (Its pull was in flight for the whole call: closing the generator could
    not reach it, and the call ran on to its end.)"""
    replica = SlowReplica()

    async def run():
        response, reading = await reading_a_unary_call(replica)
        response.cancel()
        with pytest.raises(RequestCancelledError):
            await asyncio.wait_for(reading, 5)

    asyncio.run(run())
    assert replica.stream_ended == "cancelled"


def test_a_unary_call_whose_request_is_cancelled_is_cancelled_not_refused():
    """The client left (the request's own task cancelled): a CancelledError, as before."""
    replica = SlowReplica()

    async def run():
        _, reading = await reading_a_unary_call(replica)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading

    asyncio.run(run())
    assert replica.stream_ended == "cancelled"


def test_model_info_is_the_replicas():
    async def run():
        return await InProcessReplica(Replica()).model_info.remote()

    assert asyncio.run(run())["max_model_len"] == 2048


def direct_args():
    args = yaml.safe_load(yaml.safe_dump(LOCAL))
    args["models"][0]["direct_route"] = True
    return args


def test_a_direct_model_is_not_bound_in_the_main_application_but_in_its_own():
    args = direct_args()
    assert set(build_app(args)._bound_deployment.init_args[1]) == {"minilm"}
    [entry] = direct_apps(args)
    assert (entry["name"], entry["route_prefix"]) == ("direct-tiny-llama", "/direct/tiny-llama")
    assert entry["import_path"] == "serve_app.app:build_direct_app"
    deployment = build_direct_app(entry["args"])._bound_deployment
    assert deployment.name == "model-tiny-llama"  # the name the ingress' handle asks for
    # HAProxy picks the replica; Serve refuses a custom router on an application's ingress.
    assert deployment._deployment_config.request_router_config.request_router_class.endswith(
        "PowerOfTwoChoicesRequestRouter"
    )
    assert direct_apps(LOCAL) == []


@pytest.mark.parametrize(
    "routing, deployment, at_the_edge",
    [
        ({}, {"num_replicas": 2}, True),  # prefix affinity (the default) on two replicas
        ({"policy": "cache_affinity"}, {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}, True),
        ({}, {"num_replicas": 1}, False),  # one replica: nothing to choose
        ({"policy": "power_of_two"}, {"num_replicas": 2}, False),  # HAProxy's least connections
    ],
)
def test_a_direct_model_routed_with_affinity_on_several_replicas_is_routed_at_the_edge(
    routing, deployment, at_the_edge, monkeypatch
):
    from ray.serve._private import constants

    from serve_app.http.edge_router import EdgeRouter

    monkeypatch.setattr(constants, "RAY_SERVE_ENABLE_HA_PROXY", True)  # as the Makefile runs Serve

    args = direct_args()
    base = {k: v for k, v in args["models"][0]["deployment"].items() if k != "num_replicas"}
    args["models"][0].update(routing=routing, deployment={**base, **deployment})
    app = build_direct_app({**args, "direct_model": "tiny-llama"})
    router = app._ingress_request_router
    config = app._bound_deployment._deployment_config.request_router_config
    if at_the_edge:
        # The model's own router picks the replica, at the edge and for the ingress' handle calls.
        assert router._bound_deployment.func_or_class is EdgeRouter
        assert router._bound_deployment.name == "edge-router-tiny-llama"  # unique beside other models'
        assert config.request_router_class.startswith("serve_app.routing.serve_routers:")
    else:
        assert router is None and config.request_router_class.endswith("PowerOfTwoChoicesRequestRouter")


def test_the_edge_router_reads_a_body_it_cannot_parse_as_no_prompt():
    from serve_app.http.edge_router import routing_body

    assert routing_body(b'{"model": "m", "prompt": "hi"}') == {"model": "m", "prompt": "hi"}
    for raw in (b"", b"{truncated", b"[1, 2]", b'"text"', b"\xff\xfe"):
        assert routing_body(raw) == {}


def test_build_direct_app_names_the_model_or_refuses():
    with pytest.raises(ValueError, match="direct_route"):
        build_direct_app({**LOCAL, "direct_model": "tiny-llama"})  # no model has direct_route
    with pytest.raises(ValueError, match="direct_route"):
        build_direct_app({**direct_args(), "direct_model": "minilm"})


def test_the_direct_app_serves_exactly_its_declared_routes_and_no_schema():
    served = {(method, route.path) for route in direct_app.routes for method in route.methods}
    assert served == set(DIRECT_ROUTES)
    # For a key: what the edge's one hop sends it (contract/edge.py) and its model list;
    # without one, only the names the edge reads (never through the edge).
    from contract.edge import EDGE_NAMES_PATH, ONE_HOP_ROUTES

    assert {route for route, kind in DIRECT_ROUTES.items() if kind == "key"} == {
        ("POST", path) for path in ONE_HOP_ROUTES
    } | {("GET", "/v1/models")}
    assert {route for route, kind in DIRECT_ROUTES.items() if kind != "key"} == {("GET", EDGE_NAMES_PATH)}
    assert direct_app.openapi_url is None and direct_app.docs_url is None


def test_llmctl_run_declares_the_direct_applications_a_config_asks_for():
    from serve_app.app import with_direct_apps

    shipped = yaml.safe_load(open("configs/local.yaml"))
    config = yaml.safe_load(yaml.safe_dump(shipped))
    config["applications"][0]["args"] = yaml.safe_load(yaml.safe_dump(LOCAL))
    assert with_direct_apps(config) is config  # nothing asked: the operator's file as it is
    config["applications"][0]["args"]["models"][0]["direct_route"] = True
    expanded = with_direct_apps(config)
    assert [app["name"] for app in expanded["applications"]] == ["llm", "direct-tiny-llama"]
    assert with_direct_apps(expanded) is expanded  # declared already: not twice
    # As shipped, each model is served behind its direct route (/v1 in one hop), none in the main application.
    assert [app["name"] for app in with_direct_apps(shipped)["applications"]] == [
        "llm",
        "direct-tiny-llama",
        "direct-minilm",
    ]
    assert build_app(SHIPPED)._bound_deployment.init_args[1] == {}


def test_llmctl_run_refuses_a_direct_application_declared_with_other_args(tmp_path, capsys, monkeypatch):
    import json

    from serve_app.app import with_direct_apps
    from serve_app.ops import local_stack

    monkeypatch.setattr(local_stack, "running_stack_pid", lambda: None)
    monkeypatch.setattr(local_stack.subprocess, "Popen", None)  # nothing may start
    config = json.loads(json.dumps(with_direct_apps(yaml.safe_load(open("configs/local.yaml")))))
    config["applications"][0]["args"]["models"][0]["engine_kwargs"]["max_model_len"] = 1024  # not in the copies
    path = tmp_path / "stale.yaml"
    path.write_text(yaml.safe_dump(config))
    assert local_stack.run(path) == 2
    err = capsys.readouterr().err
    assert "'direct-tiny-llama': args must be the args of application 'llm' plus direct_model" in err


@pytest.mark.parametrize(
    "policy, replicas, at_the_edge",
    [
        ("power_of_two", 2, True),  # the replica holding the adapter is chosen at the edge whatever the policy
        ("prefix_affinity", 1, False),  # one replica: it loads every adapter asked of it
    ],
)
def test_a_direct_model_with_adapters_on_several_replicas_is_routed_at_the_edge_by_adapter(
    policy, replicas, at_the_edge, monkeypatch
):
    from ray.serve._private import constants

    from serve_app.http.edge_router import EdgeRouter

    monkeypatch.setattr(constants, "RAY_SERVE_ENABLE_HA_PROXY", True)
    args = direct_args()
    model = args["models"][0]
    model.update(routing={"policy": policy}, lora={"adapters": {"pirate": "demo"}, "dir": "/adapters"})
    model["deployment"] = {**model["deployment"], "num_replicas": replicas}
    app = build_direct_app({**args, "direct_model": "tiny-llama"})
    router = app._ingress_request_router
    assert (router is not None and router._bound_deployment.func_or_class is EdgeRouter) == at_the_edge
    if at_the_edge:
        # It is given the model's config: it names an adapter as the gateway does.
        config = router._bound_deployment.init_args[1]
        assert [config.adapter_named(m) for m in ("pirate", "tiny-llama:sql", "tiny-llama")] == [
            "pirate",
            "tiny-llama:sql",
            None,
        ]


def test_every_deployment_runs_with_the_raised_transport_limit_beside_its_own_env():
    from serve_app.app import TRANSPORT_ENV

    args = direct_args()
    ingress = build_app(args)._bound_deployment
    [minilm] = ingress.init_args[1].values()
    direct = build_direct_app(direct_apps(args)[0]["args"])._bound_deployment
    for deployment in (ingress, minilm._bound_deployment, direct):
        env = deployment.ray_actor_options["runtime_env"]["env_vars"]
        assert TRANSPORT_ENV.items() <= env.items(), deployment.name
    # A model's own env vars stay (configs/local.yaml's VLLM_CPU_KVCACHE_SPACE).
    assert minilm._bound_deployment.ray_actor_options["runtime_env"]["env_vars"]["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_with_a_traces_endpoint_every_deployment_exports_under_its_own_service_name():
    args = {
        **direct_args(),
        "telemetry": {"tracing": {"endpoint": "http://collector:4318/v1/traces", "sample_ratio": 0.25}},
    }
    ingress = build_app(args)._bound_deployment
    [minilm] = ingress.init_args[1].values()
    direct = build_direct_app(direct_apps(args)[0]["args"])._bound_deployment
    services = {}
    for deployment in (ingress, minilm._bound_deployment, direct):
        env = deployment.ray_actor_options["runtime_env"]["env_vars"]
        assert env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == "http://collector:4318/v1/traces"
        # The gateway samples at the ratio; every other tracer (vLLM's) only under a sampled parent.
        assert (env["OTEL_TRACES_SAMPLER"], env["LLM_TRACES_SAMPLE_RATIO"]) == ("parentbased_always_off", "0.25")
        services[deployment.name] = env["OTEL_SERVICE_NAME"]
    assert services[ingress.name] == "llm-gateway" and len(set(services.values())) == 3
    # Unset (as shipped): no OTEL_* variable at all, the SDK is never configured.
    env = build_app(direct_args())._bound_deployment.ray_actor_options["runtime_env"]["env_vars"]
    assert not [name for name in env if name.startswith("OTEL_")]
