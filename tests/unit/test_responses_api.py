"""The Responses API's state, with the Redis store faked by a dict (the real
path, on Redis and two ingress replicas: tests/e2e/quota_stack/test_1_responses_e2e.py):
what a follow-up sends the engine, what is stored and for whom, what the client
is told."""

import json

import pytest

from serve_app.errors import OpenAIError
from serve_app.identity.keys import KeyRecord
from serve_app.stored import responses_api, stored_responses
from serve_app.wire.api_requests import list_params
from serve_app.wire.calls import Reply

KEY = KeyRecord(id="k1", name="a", created_at=0)
OTHER = KeyRecord(id="k2", name="b", created_at=0)
ANSWER = {
    "id": "resp_1",
    "object": "response",
    "store": False,
    "previous_response_id": None,
    "output": [
        {
            "id": "msg_o",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Hello!", "annotations": []}],
        }
    ],
    "usage": {"input_tokens": 5, "output_tokens": 2, "total_tokens": 7},
}


class FakeRedis:
    def __init__(self):
        self.values = {}
        self.reads = []  # (command, name)

    async def get(self, name):
        self.reads.append(("GET", name))
        return self.values.get(name)

    async def getrange(self, name, start, end):  # Redis': ``end`` included
        self.reads.append(("GETRANGE", name))
        return self.values.get(name, "")[start : end + 1]

    async def strlen(self, name):
        self.reads.append(("STRLEN", name))
        return len(self.values.get(name, ""))

    async def set(self, name, value, ex):
        assert ex == stored_responses.RETENTION_S
        self.values[name] = value

    async def delete(self, name):
        return int(self.values.pop(name, None) is not None)


class FakeAccount:
    """The key's storage account (serve_app/accounting/storage_account.py; its script runs on a
    real Redis in tests/integration/test_file_space.py): what each key holds, by object."""

    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = max_bytes
        self.held: dict[str, dict[str, int]] = {}

    async def reserve(self, key_id, object_id, size, expires_s):
        held = self.held.setdefault(key_id, {})
        if sum(held.values()) + size > self.max_bytes:
            raise OpenAIError(400, "full", param="store", code="storage_limit_exceeded")
        held[object_id] = size

    async def record(self, key_id, object_id, size, expires_s):
        self.held.setdefault(key_id, {})[object_id] = size

    async def release(self, key_id, object_id):
        self.held.get(key_id, {}).pop(object_id, None)


@pytest.fixture
def store():
    return stored_responses.ResponseStore(FakeRedis(), FakeAccount())


async def answered(store, body, key=KEY, answer=ANSWER):
    call = await responses_api.translate(body, key, store)
    if call.once_admitted is not None:  # as the gateway does, once the key's quotas admit it
        await call.once_admitted()
    response = await call.respond(Reply(body=json.dumps(answer).encode()))
    return call, json.loads(response.body)


async def test_a_first_turn_runs_stateless_and_is_stored_for_its_key(store):
    call, reply = await answered(store, {"model": "m", "input": "Hi"})
    assert call.operation.name == "responses"
    assert call.body == {"model": "m", "input": [{"type": "message", "role": "user", "content": "Hi"}], "store": False}
    assert reply["store"] is True and reply["previous_response_id"] is None  # as the client asked
    stored = await store.get("k1", "resp_1")
    assert stored["response"]["store"] is True and stored["response"]["output"] == ANSWER["output"]
    assert [item["content"] for item in stored["input_items"]] == ["Hi"] and stored["input_items"][0]["id"]
    assert await store.get("k2", "resp_1") is None  # another key never finds it


async def test_a_follow_up_sends_the_whole_conversation_and_names_its_previous_response(store):
    await answered(store, {"model": "m", "input": "Hi", "instructions": "Be brief."})
    second = {**ANSWER, "id": "resp_2"}
    call, reply = await answered(
        store, {"model": "m", "input": "And you?", "previous_response_id": "resp_1"}, answer=second
    )
    assert call.body["input"] == [
        {"type": "message", "role": "user", "content": "Hi"},
        ANSWER["output"][0],  # the answer goes back as an input item
        {"type": "message", "role": "user", "content": "And you?"},
    ]
    assert "instructions" not in call.body  # not carried over, as OpenAI does
    assert reply["previous_response_id"] == "resp_1"
    stored = await store.get("k1", "resp_2")
    assert [item["content"] for item in stored["input_items"]] == ["And you?"]  # its own input only
    assert len(stored["context"]) == 3


async def test_a_follow_up_is_priced_by_its_history_and_reads_it_only_once_admitted(store):
    await answered(store, {"model": "m", "input": "x" * 30_000})
    name = stored_responses.redis_names.stored_response("k1", "resp_1")
    store.redis.reads.clear()
    call = await responses_api.translate(
        {"model": "m", "input": "And you?", "previous_response_id": "resp_1"}, KEY, store
    )
    assert store.redis.reads == [("GETRANGE", name)]  # its size, not the conversation
    stored = json.loads(store.redis.values[name])
    history = stored["context"] + stored_responses.as_input(stored["response"]["output"])
    assert call.bytes_once_admitted == stored["history_bytes"]
    assert abs(call.bytes_once_admitted - len(json.dumps(history))) <= 4  # the JSON list's separators
    assert len(call.body["input"]) == 1  # its own input until admitted
    await call.once_admitted()
    assert store.redis.reads[-1] == ("GET", name) and len(call.body["input"]) == 3


async def test_a_response_stored_before_records_said_their_size_is_priced_by_its_length(store):
    name = stored_responses.redis_names.stored_response("k1", "resp_old")
    store.redis.values[name] = json.dumps({"response": ANSWER, "context": [], "input_items": []})
    call = await responses_api.translate(
        {"model": "m", "input": "more", "previous_response_id": "resp_old"}, KEY, store
    )
    assert call.bytes_once_admitted == len(store.redis.values[name])
    await call.once_admitted()
    assert call.body["input"][0] == ANSWER["output"][0]


async def test_a_follow_up_whose_history_was_deleted_after_its_size_was_read_is_a_404(store):
    await answered(store, {"model": "m", "input": "Hi"})
    call = await responses_api.translate({"model": "m", "input": "more", "previous_response_id": "resp_1"}, KEY, store)
    await responses_api.delete(store, KEY, "resp_1")
    with pytest.raises(OpenAIError) as caught:
        await call.once_admitted()
    assert caught.value.status == 404 and caught.value.code == "response_not_found"


async def test_another_keys_response_is_not_found(store):
    await answered(store, {"model": "m", "input": "Hi"})
    with pytest.raises(OpenAIError) as caught:
        await responses_api.translate({"model": "m", "input": "x", "previous_response_id": "resp_1"}, OTHER, store)
    assert caught.value.status == 404 and caught.value.code == "response_not_found"
    with pytest.raises(OpenAIError) as caught:
        await responses_api.retrieve(store, OTHER, "resp_1")
    assert caught.value.status == 404
    with pytest.raises(OpenAIError):
        await responses_api.delete(store, OTHER, "resp_1")
    assert (await responses_api.retrieve(store, KEY, "resp_1"))["response"]["id"] == "resp_1"


async def test_store_false_keeps_nothing_and_says_so(store):
    _, reply = await answered(store, {"model": "m", "input": "Hi", "store": False})
    assert reply["store"] is False and await store.get("k1", "resp_1") is None


async def test_delete_then_the_id_is_gone(store):
    await answered(store, {"model": "m", "input": "Hi"})
    assert await responses_api.delete(store, KEY, "resp_1") == {"id": "resp_1", "object": "response", "deleted": True}
    with pytest.raises(OpenAIError) as caught:
        await responses_api.delete(store, KEY, "resp_1")
    assert caught.value.status == 404


async def test_a_streamed_answer_is_stamped_and_its_completed_response_stored(store):
    call = await responses_api.translate(
        {"model": "m", "input": "Hi", "stream": True, "previous_response_id": None}, KEY, store
    )

    def event(kind, data):
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'))}\n\n"

    created = event("response.created", {"response": {**ANSWER, "output": []}})
    delta = event("response.output_text.delta", {"delta": '"store":false'})  # generated text is escaped
    completed = event("response.completed", {"response": ANSWER})

    async def stream():
        for item in (created, delta, completed):
            yield item

    response = await call.respond(Reply(stream=stream()))
    items = [item async for item in response.body_iterator]
    assert '"store":true' in items[0] and '"store":true' in items[2]
    assert items[1] == delta  # \"store\":false inside the text is left alone
    assert (await store.get("k1", "resp_1"))["response"]["store"] is True


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "m", "input": "x", "previous_response_id": 5}, "previous_response_id"),
        ({"model": "m", "input": "x", "previous_response_id": ""}, "previous_response_id"),
        ({"model": "m", "input": "x", "store": "yes"}, "store"),
        ({"model": "m", "input": {}}, "input"),
        ({"model": "m", "input": []}, "input"),
        ({"model": "m"}, "input"),
    ],
)
async def test_mistakes_are_a_400_naming_the_field(store, body, param):
    with pytest.raises(OpenAIError) as caught:
        await responses_api.translate(body, KEY, store)
    assert caught.value.status == 400 and caught.value.param == param


async def test_a_stored_response_counts_what_it_holds_in_its_keys_account(store):
    call = await responses_api.translate({"model": "m", "input": "Hi"}, KEY, store)
    [(pending, reserved)] = store.space.held["k1"].items()
    assert pending.startswith("pending-") and reserved > len(json.dumps(call.body["input"]))
    await call.respond(Reply(body=json.dumps(ANSWER).encode()))
    stored = store.space.held["k1"]
    assert list(stored) == ["resp_1"] and stored["resp_1"] == len(
        store.redis.values[stored_responses.redis_names.stored_response("k1", "resp_1")]
    )
    await responses_api.delete(store, KEY, "resp_1")
    assert store.space.held["k1"] == {}


async def test_a_response_past_the_keys_storage_bound_is_refused_before_it_runs(store):
    store.space.max_bytes = 100_000
    with pytest.raises(OpenAIError) as caught:
        await responses_api.translate({"model": "m", "input": "x" * 60_000}, KEY, store)
    assert caught.value.status == 400 and caught.value.code == "storage_limit_exceeded"
    assert store.space.held["k1"] == {}  # nothing held by a refusal
    call = await responses_api.translate({"model": "m", "input": "x" * 60_000, "store": False}, KEY, store)
    assert call.abandon is not None and store.space.held["k1"] == {}  # store false: nothing to count


async def test_a_response_that_never_ran_or_never_completed_gives_its_room_back(store):
    call = await responses_api.translate({"model": "m", "input": "Hi"}, KEY, store)
    await call.abandon()  # refused by the gateway (a 429, a 503)
    assert store.space.held["k1"] == {}
    call = await responses_api.translate({"model": "m", "input": "Hi", "stream": True}, KEY, store)

    async def failing():
        yield "event: response.created\ndata: {}\n\n"
        raise RuntimeError("the replica died")

    response = await call.respond(Reply(stream=failing()))
    with pytest.raises(RuntimeError):
        _ = [item async for item in response.body_iterator]
    assert store.space.held["k1"] == {} and store.redis.values == {}


async def test_a_conversation_too_large_to_store_is_refused_before_it_runs(store, monkeypatch):
    monkeypatch.setattr(responses_api, "MAX_STORED_BYTES", 1000)
    with pytest.raises(OpenAIError) as caught:
        await responses_api.translate({"model": "m", "input": "x" * 2000}, KEY, store)
    assert caught.value.status == 400 and caught.value.code == "conversation_too_large"
    call = await responses_api.translate({"model": "m", "input": "x" * 2000, "store": False}, KEY, store)
    assert call.body["store"] is False  # nothing to keep: no bound


def test_input_items_list_as_openai_lists_them():
    items = stored_responses.with_ids(
        [
            {"type": "message", "role": "user", "content": "Hi"},
            {"role": "user", "content": [{"type": "input_text", "text": "Yo"}]},
        ]
    )
    listed = stored_responses.item_list(items, order="asc")
    assert listed["object"] == "list" and listed["has_more"] is False
    assert [item["content"] for item in listed["data"]] == [
        [{"type": "input_text", "text": "Hi"}],
        [{"type": "input_text", "text": "Yo"}],
    ]
    assert listed["first_id"] == listed["data"][0]["id"] and listed["last_id"] == listed["data"][1]["id"]
    assert stored_responses.item_list(items)["data"] == listed["data"][::-1]  # newest first by default


def test_input_items_page_by_limit_and_after():
    items = stored_responses.with_ids([{"role": "user", "content": str(i)} for i in range(5)])
    first = stored_responses.item_list(items, limit=2, order="asc")
    assert [item["content"][0]["text"] for item in first["data"]] == ["0", "1"] and first["has_more"]
    rest = stored_responses.item_list(items, limit=10, order="asc", after=first["last_id"])
    assert [item["content"][0]["text"] for item in rest["data"]] == ["2", "3", "4"] and not rest["has_more"]
    with pytest.raises(OpenAIError) as caught:
        stored_responses.item_list(items, after="msg_unknown")
    assert caught.value.param == "after"


@pytest.mark.parametrize(
    "params, param",
    [
        ({"limit": "0"}, "limit"),
        ({"limit": "101"}, "limit"),
        ({"limit": "-1"}, "limit"),
        ({"limit": "x"}, "limit"),
        ({"order": "up"}, "order"),
    ],
)
def test_a_bad_page_is_a_400_naming_the_parameter(params, param):
    with pytest.raises(OpenAIError) as caught:
        list_params(params)
    assert caught.value.status == 400 and caught.value.param == param
    assert list_params({}) == {"limit": 20, "order": "desc", "after": None}
    assert list_params({"limit": "10000"}, max_limit=10_000)["limit"] == 10_000  # the files listing's bound
