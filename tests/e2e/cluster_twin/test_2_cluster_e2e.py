"""The cluster workflow on this machine, through Ray's own launcher and CLIs
(the package's cluster, conftest.py): `ray up cluster.local.yaml`, `serve deploy`
of the multi-model config (more than the head can hold, so Ray's autoscaler adds
a fake worker node), SDK calls, a rollout of a changed model with `serve deploy`
while streams are in flight (none may fail), `serve shutdown` (the idle worker
is removed), `ray down`."""

from __future__ import annotations

import time

import openai
import pytest
from stack import create_key
from streaming_load import StreamingLoad

from cluster_twin.twin import alive_nodes, cli, running_replica_ids, twin_config, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CHAT = "tiny-llama"
STREAM = {
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 200,
    "temperature": 0,
    "extra_body": {"min_tokens": 200, "ignore_eos": True},
}


def test_more_replicas_than_the_head_holds_adds_a_worker_node(deployed, cluster):
    assert alive_nodes(cluster) >= 2


def test_every_model_answers_through_the_cluster(deployed, redis_server):
    _, secret = create_key(redis_server.url, "local-cluster")
    client = openai.OpenAI(base_url=deployed["url"] + "/v1", api_key=secret, max_retries=0, timeout=120)
    for model in ("tiny-llama", "small-llama", "small-llama-pirate"):
        assert client.chat.completions.create(model=model, messages=STREAM["messages"], max_tokens=4).model == model
    assert len(client.embeddings.create(model="minilm", input="hi").data[0].embedding) == 384


def test_rollout_with_serve_deploy_finishes_every_stream_in_flight(deployed, cluster, redis_server, adapter_dir):
    _, secret = create_key(redis_server.url, "rollout")
    before = running_replica_ids("model-tiny-llama")
    load = StreamingLoad(deployed["url"], secret, CHAT, STREAM)
    try:
        load.add(3)
        time.sleep(3)
        # A new version of the model: new engine options, so Serve replaces its replicas.
        # The other models leave the deployment in the same change: any change to the
        # application's args replaces every model's replicas (docs/operating.md,
        # "Rolling out"), and four engines loading at once on two cores took 340 s.
        new = twin_config(
            deployed["tmp"],
            deployed["port"],
            adapter_dir,
            only=[CHAT],
            **{CHAT: {"engine_kwargs": {"max_model_len": 2048, "max_num_seqs": 32}}},
        )
        deployed_at = time.monotonic()
        cli("serve", "deploy", str(new), env=cluster)
        wait_until(
            lambda: (ids := running_replica_ids("model-tiny-llama")) and not ids & before,
            600,
            "the new tiny-llama replica to replace the old one",
        )
        replaced_s = time.monotonic() - deployed_at
        time.sleep(3)  # streams keep flowing on the new replica
    finally:
        stopping_at = time.monotonic()
        load.stop()
    print(
        f"\nstreams during the rollout: {dict(load.outcomes)}; new replica running {replaced_s:.0f} s "
        f"after `serve deploy`, the load's last streams ended in {time.monotonic() - stopping_at:.0f} s"
    )
    assert load.outcomes["error"] == 0, load.errors[:3]
    assert set(load.outcomes) == {"complete"} and load.outcomes["complete"] >= 3


def test_removing_the_load_removes_the_worker_node(deployed, cluster):
    cli("serve", "shutdown", "-y", env=cluster)
    wait_until(lambda: alive_nodes(cluster) == 1, 300, "the idle worker node to be removed")
