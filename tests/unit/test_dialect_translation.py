"""Each dialect's translation into the canonical OpenAI request, and of the
answer back (pure logic; the end-to-end path: tests/e2e/shared_stack/test_dialects_e2e.py).
The gateway is faked by what the dialects ask of it: the one model serving an
operation, a model's card and context length."""

import json

import pytest

from serve_app.dialects import anthropic, azure, databricks, sagemaker
from serve_app.errors import OpenAIError
from serve_app.wire.api_requests import TEMPLATED_COMPLETIONS
from serve_app.wire.calls import Reply


class Registry:
    """The few questions dialects ask the gateway."""

    def __init__(self, only="tiny-llama", context=128):
        self.only, self.context = only, context

    async def only_model_for(self, operation):
        if self.only is None:
            raise OpenAIError(400, "Missing required parameter: 'model'.", param="model")
        return self.only

    async def model_card(self, model):
        return {"id": model}

    def resolve(self, model):
        return model

    def authorized(self, key, model):
        return model

    def context_length(self, name):
        return self.context


# -- SageMaker LMI -------------------------------------------------------------------


async def test_lmi_inputs_become_a_greedy_completion_of_the_only_model():
    call = await sagemaker.translate(
        {"inputs": "Hi", "parameters": {"max_new_tokens": 5, "stop_sequences": ["."]}}, Registry()
    )
    assert call.operation == "completions"
    assert call.body == {"prompt": "Hi", "max_tokens": 5, "stop": ["."], "temperature": 0, "model": "tiny-llama"}


async def test_lmi_sampling_and_details_map_to_vllm_parameters():
    call = await sagemaker.translate(
        {
            "inputs": ["a", "b"],
            "parameters": {"do_sample": True, "temperature": 0.7, "details": True, "ignore_eos_token": True},
        },
        Registry(),
    )
    assert call.body["prompt"] == ["a", "b"] and call.body["temperature"] == 0.7
    assert call.body["logprobs"] == 0 and call.body["return_token_ids"] and call.body["ignore_eos"]
    assert call.body["max_tokens"] == sagemaker.LMI_DEFAULT_MAX_NEW_TOKENS


@pytest.mark.parametrize(
    "body, param",
    [
        ({"inputs": "a", "parameters": {"best_of": 2}}, "parameters.best_of"),
        ({"inputs": "a", "extra": 1}, "extra"),
        ({"inputs": 7}, "inputs"),
        ({"inputs": []}, "inputs"),
        ({"inputs": ["a", 1]}, "inputs"),
        ({"inputs": ["a"], "stream": True}, "inputs"),
        ({"inputs": "a", "parameters": []}, "parameters"),
        ({"text": "a"}, "inputs"),
    ],
)
async def test_lmi_mistakes_are_a_400_naming_the_field(body, param):
    with pytest.raises(OpenAIError) as caught:
        await sagemaker.translate(body, Registry())
    assert caught.value.status == 400 and caught.value.param == param


async def test_sagemaker_openai_shapes_pass_through_with_the_only_model():
    chat = await sagemaker.translate({"messages": [{"role": "user", "content": "hi"}]}, Registry())
    assert chat.operation == "chat" and chat.body["model"] == "tiny-llama"
    named = await sagemaker.translate({"prompt": "hi", "model": "other"}, Registry(only=None))
    assert named.operation == "completions" and named.body["model"] == "other"


async def test_lmi_answer_is_generated_text_with_lmi_finish_reasons():
    call = await sagemaker.translate(
        {"inputs": "Hi", "parameters": {"details": True, "return_full_text": True}}, Registry()
    )
    completion = {
        "choices": [
            {
                "index": 0,
                "text": " there",
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": [5, 6],
                "logprobs": {"tokens": [" th", "ere"], "token_logprobs": [-1.0, -2.0]},
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
    }
    response = call.respond(Reply(body=json.dumps(completion).encode()))
    answer = json.loads(response.body)
    assert answer["generated_text"] == "Hi there"
    assert answer["details"]["finish_reason"] == "length"
    assert [t["id"] for t in answer["details"]["tokens"]] == [5, 6]


# -- Databricks -------------------------------------------------------------------------


async def test_databricks_prompt_goes_through_the_chat_template_and_back():
    call = await databricks.translate("m", {"prompt": "Hi", "max_tokens": 3, "echo": True}, Registry())
    assert call.operation is TEMPLATED_COMPLETIONS and call.operation.replica_operation == "templated_completions"
    assert call.operation.name == "completions"  # admitted, reserved and accounted as completions
    assert call.body == {"model": "m", "prompt": "Hi", "max_tokens": 3}  # echo is the dialect's
    answer = json.loads(call.respond(Reply(body=json.dumps(completion(" there")).encode())).body)
    assert answer["object"] == "text_completion" and answer["choices"][0]["text"] == "Hi there"


def completion(*texts, finish="stop"):
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [
            {"index": i, "text": text, "finish_reason": finish, "logprobs": None} for i, text in enumerate(texts)
        ],
        "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
    }


async def test_databricks_prompt_list_is_templated_prompt_by_prompt_with_echo_and_suffix_per_choice():
    body = {"prompt": ["Hi", "Yo"], "n": 2, "echo": True, "suffix": "!"}
    call = await databricks.translate("m", body, Registry())
    assert call.operation is TEMPLATED_COMPLETIONS and call.body["prompt"] == ["Hi", "Yo"]
    assert "suffix" not in call.body and "echo" not in call.body
    answer = json.loads(call.respond(Reply(body=json.dumps(completion("a", "b", "c", "d")).encode())).body)
    # n=2: choices 0, 1 answer the first prompt, 2, 3 the second
    assert [c["text"] for c in answer["choices"]] == ["Hia!", "Hib!", "Yoc!", "Yod!"]


async def test_databricks_suffix_ends_each_streamed_choice_once_and_echo_starts_it_once():
    call = await databricks.translate(
        "m", {"prompt": ["Hi", "Yo"], "echo": True, "suffix": "?", "stream": True}, Registry()
    )

    async def stream():
        chunk = lambda index, text, finish=None: {  # noqa: E731
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": [{"index": index, "text": text, "finish_reason": finish}],
        }
        yield "".join(f"data: {json.dumps(c)}\n\n" for c in (chunk(0, " a"), chunk(1, " b")))
        yield "".join(f"data: {json.dumps(c)}\n\n" for c in (chunk(0, " c", "stop"), chunk(1, " d", "length")))
        usage = {"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 4}}
        yield f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n"

    response = call.respond(Reply(stream=stream()))
    items = [item async for item in response.body_iterator]
    assert items[-1].endswith("data: [DONE]\n\n")
    texts = {0: "", 1: ""}
    for item in items:
        for event in item.split("\n\n"):
            if event.startswith("data: {"):
                for choice in json.loads(event[6:])["choices"]:
                    texts[choice["index"]] += choice["text"]
    assert texts == {0: "Hi a c?", 1: "Yo b d?"}


async def test_databricks_raw_prompt_gets_the_suffix_but_its_echo_is_vllms():
    call = await databricks.translate(
        "m", {"prompt": [[1, 2]], "use_raw_prompt": True, "echo": True, "suffix": "."}, Registry()
    )
    assert call.operation == "completions" and call.body["echo"] is True and "suffix" not in call.body
    answer = json.loads(call.respond(Reply(body=json.dumps(completion("x", finish="length")).encode())).body)
    assert answer["choices"][0]["text"] == "x."


async def test_databricks_raw_prompt_truncation_leaves_room_for_max_tokens():
    call = await databricks.translate(
        "m",
        {"prompt": ["a", "b"], "use_raw_prompt": True, "error_behavior": "truncate", "max_tokens": 10},
        Registry(context=128),
    )
    assert call.operation == "completions" and call.body["truncate_prompt_tokens"] == 118


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "a", "error_behavior": "ignore"}, "error_behavior"),
        ({"prompt": "a", "use_raw_prompt": "yes"}, "use_raw_prompt"),
        ({"prompt": [1, 2]}, "prompt"),  # token ids are raw
        ({"prompt": [[1], [2]]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", 2]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": "a", "suffix": 7}, "suffix"),
        ({"prompt": "a", "echo": "yes"}, "echo"),
        ({"prompt": "a", "error_behavior": "truncate", "max_tokens": 128}, "max_tokens"),
        ({"prompt": "a", "error_behavior": "truncate", "max_tokens": "10"}, "max_tokens"),
        ({"input": [1, 2], "instruction": "q:"}, "instruction"),
        ({"input": "a", "instruction": 7}, "instruction"),
        ({"query": "a"}, "messages"),
    ],
)
async def test_databricks_mistakes_are_a_400_naming_the_field(body, param):
    with pytest.raises(OpenAIError) as caught:
        await databricks.translate("m", body, Registry(context=128))
    assert caught.value.status == 400 and caught.value.param == param


async def test_databricks_embedding_instruction_prefixes_every_input():
    call = await databricks.translate("e", {"input": ["x", "y"], "instruction": "query:"}, Registry())
    assert call.operation == "embeddings" and call.body["input"] == ["query: x", "query: y"]


# -- Azure AI model inference -------------------------------------------------------------


async def test_azure_deployment_header_names_the_model_and_input_type_is_dropped():
    call = await azure.translate(
        "embeddings", {"input": ["a"], "input_type": "query"}, {"azureml-model-deployment": "minilm"}, Registry()
    )
    assert call.body == {"input": ["a"], "model": "minilm"}


async def test_azure_extra_parameters_follow_the_header():
    body = {"messages": [], "logit_bias": {"1": 2}}
    with pytest.raises(OpenAIError) as caught:
        await azure.translate("chat", dict(body), {}, Registry())
    assert caught.value.status == 422 and caught.value.param == "logit_bias"
    dropped = await azure.translate("chat", dict(body), {"extra-parameters": "drop"}, Registry())
    assert "logit_bias" not in dropped.body and dropped.body["model"] == "tiny-llama"
    passed = await azure.translate("chat", dict(body), {"extra-parameters": "pass-through"}, Registry())
    assert passed.body["logit_bias"] == {"1": 2}
    with pytest.raises(OpenAIError) as caught:
        await azure.translate("chat", dict(body), {"extra-parameters": "sometimes"}, Registry())
    assert caught.value.status == 400 and caught.value.param == "extra-parameters"


def test_azure_errors_use_422_for_parameters_and_carry_the_error_code_header():
    response = azure.error_response(OpenAIError(400, "bad", param="temperature", code="invalid_value"))
    assert response.status_code == 422 and response.headers["x-ms-error-code"] == "invalid_value"
    response = azure.error_response(OpenAIError(401, "no key"))
    assert response.status_code == 401 and response.headers["x-ms-error-code"] == "Unauthorized"


# -- Anthropic Messages -------------------------------------------------------------------


@pytest.mark.parametrize(
    "status, kind",
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "overloaded_error"),
        (502, "api_error"),
        (422, "invalid_request_error"),
    ],
)
def test_anthropic_errors_take_anthropics_shape_with_the_same_status_and_headers(status, kind):
    exc = OpenAIError(status, "Something is wrong.", param="max_tokens", headers={"retry-after": "1"})
    response = anthropic.error_response(exc)
    assert response.status_code == status and response.headers["retry-after"] == "1"
    assert json.loads(response.body) == {
        "type": "error",
        "error": {"type": kind, "message": "Something is wrong. (max_tokens)"},
    }
    named = anthropic.error_response(OpenAIError(400, "Invalid 'max_tokens': no.", param="max_tokens"))
    assert json.loads(named.body)["error"]["message"] == "Invalid 'max_tokens': no."  # named once
