"""Each dialect's translation into the canonical OpenAI request, and of the
answer back (pure logic; the end-to-end path: tests/e2e/shared_stack/test_dialects_e2e.py).
The gateway is faked by what the dialects ask of it: the one model serving an
operation, a model's card and context length."""

import json

import pytest

from serve_app.dialects import azure, databricks, sagemaker
from serve_app.errors import OpenAIError
from serve_app.calls import Reply


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

    def context_length(self, name):
        return self.context


# -- SageMaker LMI -------------------------------------------------------------------


async def test_lmi_inputs_become_a_greedy_completion_of_the_only_model():
    call = await sagemaker.translate({"inputs": "Hi", "parameters": {"max_new_tokens": 5, "stop_sequences": ["."]}},
                                     Registry())
    assert call.operation == "completions"
    assert call.body == {"prompt": "Hi", "max_tokens": 5, "stop": ["."], "temperature": 0, "model": "tiny-llama"}


async def test_lmi_sampling_and_details_map_to_vllm_parameters():
    call = await sagemaker.translate(
        {"inputs": ["a", "b"], "parameters": {"do_sample": True, "temperature": 0.7, "details": True,
                                              "ignore_eos_token": True}}, Registry())
    assert call.body["prompt"] == ["a", "b"] and call.body["temperature"] == 0.7
    assert call.body["logprobs"] == 0 and call.body["return_token_ids"] and call.body["ignore_eos"]
    assert call.body["max_tokens"] == sagemaker.LMI_DEFAULT_MAX_NEW_TOKENS


@pytest.mark.parametrize("body, param", [
    ({"inputs": "a", "parameters": {"best_of": 2}}, "parameters.best_of"),
    ({"inputs": "a", "extra": 1}, "extra"),
    ({"inputs": 7}, "inputs"),
    ({"inputs": []}, "inputs"),
    ({"inputs": ["a", 1]}, "inputs"),
    ({"inputs": ["a"], "stream": True}, "inputs"),
    ({"inputs": "a", "parameters": []}, "parameters"),
    ({"text": "a"}, "inputs"),
])
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
    call = await sagemaker.translate({"inputs": "Hi", "parameters": {"details": True, "return_full_text": True}},
                                     Registry())
    completion = {"choices": [{"index": 0, "text": " there", "finish_reason": "length", "stop_reason": None,
                               "token_ids": [5, 6], "logprobs": {"tokens": [" th", "ere"], "token_logprobs": [-1.0, -2.0]}}],
                  "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}
    response = call.respond(Reply(body=json.dumps(completion).encode()))
    answer = json.loads(response.body)
    assert answer["generated_text"] == "Hi there"
    assert answer["details"]["finish_reason"] == "length"
    assert [t["id"] for t in answer["details"]["tokens"]] == [5, 6]


# -- Databricks -------------------------------------------------------------------------


async def test_databricks_prompt_goes_through_the_chat_template_and_back():
    call = await databricks.translate("m", {"prompt": "Hi", "max_tokens": 3, "echo": True}, Registry())
    assert call.operation == "chat" and call.body["messages"] == [{"role": "user", "content": "Hi"}]
    assert call.body["model"] == "m" and "prompt" not in call.body and "echo" not in call.body
    chat = {"id": "chatcmpl-1", "created": 1, "model": "m", "usage": None,
            "choices": [{"index": 0, "message": {"content": " there"}, "finish_reason": "stop"}]}
    answer = json.loads(call.respond(Reply(body=json.dumps(chat).encode())).body)
    assert answer["object"] == "text_completion" and answer["id"] == "cmpl-1"
    assert answer["choices"][0]["text"] == "Hi there"


async def test_databricks_raw_prompt_truncation_leaves_room_for_max_tokens():
    call = await databricks.translate(
        "m", {"prompt": ["a", "b"], "use_raw_prompt": True, "error_behavior": "truncate", "max_tokens": 10},
        Registry(context=128))
    assert call.operation == "completions" and call.body["truncate_prompt_tokens"] == 118


@pytest.mark.parametrize("body, param", [
    ({"prompt": "a", "error_behavior": "ignore"}, "error_behavior"),
    ({"prompt": "a", "use_raw_prompt": "yes"}, "use_raw_prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": "a", "suffix": "z"}, "suffix"),
    ({"prompt": "a", "error_behavior": "truncate", "max_tokens": 128}, "max_tokens"),
    ({"prompt": "a", "error_behavior": "truncate", "max_tokens": "10"}, "max_tokens"),
    ({"input": [1, 2], "instruction": "q:"}, "instruction"),
    ({"input": "a", "instruction": 7}, "instruction"),
    ({"query": "a"}, "messages"),
])
async def test_databricks_mistakes_are_a_400_naming_the_field(body, param):
    with pytest.raises(OpenAIError) as caught:
        await databricks.translate("m", body, Registry(context=128))
    assert caught.value.status == 400 and caught.value.param == param


async def test_databricks_embedding_instruction_prefixes_every_input():
    call = await databricks.translate("e", {"input": ["x", "y"], "instruction": "query:"}, Registry())
    assert call.operation == "embeddings" and call.body["input"] == ["query: x", "query: y"]


# -- Azure AI model inference -------------------------------------------------------------


async def test_azure_deployment_header_names_the_model_and_input_type_is_dropped():
    call = await azure.translate("embeddings", {"input": ["a"], "input_type": "query"},
                                 {"azureml-model-deployment": "minilm"}, Registry())
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
