"""The dialects of the platforms users migrate from, end to end: Azure AI
model inference (with Microsoft's own `azure-ai-inference` SDK), SageMaker LMI,
Databricks, OpenVINO Model Server and Jan/llama.cpp parameter names. Request
bodies follow each platform's documentation."""

from __future__ import annotations

import json

import httpx
import openai
import openai_spec
import pytest
from http_checks import assert_error_envelope, sse_events
from settled import wait_until_settled
from stack import create_key

from shared_stack.stack_models import RERANKER

pytestmark = pytest.mark.e2e

CHAT_MODEL = "tiny-llama"
EMBEDDING_MODEL = "minilm"
AZURE_API_VERSION = "2024-05-01-preview"


def greedy_chat(http, messages, max_tokens=12) -> str:
    response = http.post(
        "/v1/chat/completions",
        json={"model": CHAT_MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0},
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def greedy_completion(http, prompt, max_tokens=12) -> str:
    response = http.post(
        "/v1/completions", json={"model": CHAT_MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


# -- Azure AI model inference ----------------------------------------------------------


@pytest.fixture(scope="module")
def azure_headers(api_key):
    return {"api-key": api_key}


# From Azure's REST reference ("Create chat completion" example), with the max_tokens cut.
AZURE_CHAT = {
    "messages": [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "How many languages are in the world?"},
    ],
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "max_tokens": 16,
    "seed": 42,
    "stop": ["<|endoftext|>"],
    "stream": False,
    "temperature": 0,
    "top_p": 1,
    "response_format": {"type": "text"},
}


def test_azure_chat_with_api_version_and_api_key(http, base_url, azure_headers):
    response = http.post(
        f"{base_url}/chat/completions",
        params={"api-version": AZURE_API_VERSION},
        json=AZURE_CHAT,
        headers=azure_headers,
    )
    assert response.status_code == 200, response.text
    openai_spec.validate(response.json(), "CreateChatCompletionResponse")
    assert response.json()["model"] == CHAT_MODEL  # the only chat model: no model needed
    assert response.json()["choices"][0]["message"]["content"] == greedy_chat(http, AZURE_CHAT["messages"], 16)


def test_azure_sdk_chat_and_streaming(base_url, api_key):
    from azure.ai.inference import ChatCompletionsClient
    from azure.ai.inference.models import SystemMessage, UserMessage
    from azure.core.credentials import AzureKeyCredential

    client = ChatCompletionsClient(endpoint=f"{base_url}/models", credential=AzureKeyCredential(api_key))
    messages = [SystemMessage("You are a helpful assistant."), UserMessage("How many feet are in a mile?")]
    reply = client.complete(messages=messages, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 8
    streamed = "".join(
        update.choices[0].delta.content or ""
        for update in client.complete(messages=messages, max_tokens=8, temperature=0, stream=True)
        if update.choices
    )
    assert streamed == reply.choices[0].message.content
    client.close()


def test_azure_sdk_embeddings_and_model_info(base_url, api_key):
    from azure.ai.inference import EmbeddingsClient
    from azure.core.credentials import AzureKeyCredential

    client = EmbeddingsClient(endpoint=f"{base_url}/models", credential=AzureKeyCredential(api_key))
    result = client.embed(input=["first phrase", "second phrase"], model=EMBEDDING_MODEL)
    assert [len(item.embedding) for item in result.data] == [384, 384]
    info = client.get_model_info(headers={"azureml-model-deployment": EMBEDDING_MODEL})
    assert info.model_name == EMBEDDING_MODEL and info.model_type == "embeddings"
    client.close()


def test_azure_extra_parameters_default_is_422_with_error_code(http, base_url, azure_headers):
    body = {**AZURE_CHAT, "top_k": 4}
    response = http.post(f"{base_url}/chat/completions", json=body, headers=azure_headers)
    error = assert_error_envelope(response, 422)
    assert error["param"] == "top_k" and "extra-parameters" in error["message"]
    assert response.headers["x-ms-error-code"] == "extra_parameters_not_allowed"


@pytest.mark.parametrize("mode", ["pass-through", "drop", "ignore"])
def test_azure_extra_parameters_pass_through_or_drop(http, base_url, azure_headers, mode):
    body = {**AZURE_CHAT, "top_k": 1, "logit_bias": {"5": 100}}
    response = http.post(f"{base_url}/chat/completions", json=body, headers={**azure_headers, "extra-parameters": mode})
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["message"]["content"]
    plain = greedy_chat(http, AZURE_CHAT["messages"], 16)
    if mode == "pass-through":
        assert content != plain  # the bias reached the model
    else:
        assert content == plain  # dropped: as if never sent


def test_azure_pass_through_of_an_unknown_parameter_is_422(http, base_url, azure_headers):
    body = {**AZURE_CHAT, "safe_prompt": True}
    response = http.post(
        f"{base_url}/chat/completions", json=body, headers={**azure_headers, "extra-parameters": "pass-through"}
    )
    assert_error_envelope(response, 422)
    assert response.headers["x-ms-error-code"]


def test_azure_deployment_header_selects_the_model(http, base_url, azure_headers):
    response = http.post(
        f"{base_url}/embeddings",
        json={"input": ["hello"]},
        headers={**azure_headers, "azureml-model-deployment": EMBEDDING_MODEL},
    )
    assert response.status_code == 200, response.text
    assert response.json()["model"] == EMBEDDING_MODEL
    wrong = http.post(
        f"{base_url}/chat/completions",
        json=AZURE_CHAT,
        headers={**azure_headers, "azureml-model-deployment": "no-such-model"},
    )
    assert_error_envelope(wrong, 404)
    assert wrong.headers["x-ms-error-code"] == "model_not_found"


def test_azure_errors_carry_the_error_code_header(base_url):
    response = httpx.post(f"{base_url}/chat/completions", json=AZURE_CHAT, headers={"api-key": "wrong"}, timeout=30)
    assert_error_envelope(response, 401)
    assert response.headers["x-ms-error-code"] == "invalid_api_key"


# -- SageMaker LMI ------------------------------------------------------------------------


# From the LMI "input/output schema" guide (max_new_tokens cut).
LMI_REQUEST = {
    "inputs": "What is Deep Learning?",
    "parameters": {"do_sample": True, "max_new_tokens": 8, "details": True},
}


def test_sagemaker_ping(http):
    assert http.get("/ping").status_code == 200


def test_sagemaker_lmi_text_generation_with_details(http):
    response = http.post("/invocations", json=LMI_REQUEST)
    assert response.status_code == 200, response.text
    output = response.json()
    details = output["details"]
    assert details["generated_tokens"] == len(details["tokens"]) == 8
    assert details["finish_reason"] == "length"
    # A byte-fallback token holding half a UTF-8 character has no text of its own, while
    # the detokenized whole shows the broken character as U+FFFD.
    joined = "".join(token["text"] for token in details["tokens"])
    assert joined.replace("\ufffd", "") == output["generated_text"].replace("\ufffd", "")
    assert all(isinstance(token["id"], int) and token["log_prob"] <= 0 for token in details["tokens"])


def test_sagemaker_lmi_defaults_are_greedy_and_return_full_text(http):
    body = {"inputs": "The license", "parameters": {"max_new_tokens": 6, "return_full_text": True}}
    first, second = (http.post("/invocations", json=body).json() for _ in range(2))
    assert first == second
    assert first["generated_text"] == "The license" + greedy_completion(http, "The license", 6)


def test_sagemaker_lmi_batch_inputs(http):
    response = http.post("/invocations", json={"inputs": ["The", "A"], "parameters": {"max_new_tokens": 3}})
    assert response.status_code == 200, response.text
    assert [set(output) for output in response.json()] == [{"generated_text"}, {"generated_text"}]


def test_sagemaker_lmi_stream_is_json_lines(http):
    body = {"inputs": "The license", "parameters": {"max_new_tokens": 10, "details": True}, "stream": True}
    with http.stream("POST", "/invocations", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/jsonlines")
        lines = [json.loads(line) for line in response.iter_lines() if line]
    tokens = [line["token"] for line in lines]
    assert len(tokens) == 10 and all(isinstance(token["id"], int) for token in tokens)
    assert all(line["generated_text"] is None for line in lines[:-1])
    assert lines[-1]["generated_text"] == "".join(token["text"] for token in tokens)
    assert lines[-1]["generated_text"] == greedy_completion(http, "The license", 10)
    assert lines[-1]["details"]["finish_reason"] == "length"


def test_sagemaker_messages_are_chat_and_prompt_is_completion(http):
    chat = http.post("/invocations", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat.status_code == 200, chat.text
    openai_spec.validate(chat.json(), "CreateChatCompletionResponse")
    completion = http.post("/invocations", json={"prompt": "hi", "max_tokens": 4})
    assert completion.status_code == 200, completion.text
    openai_spec.validate(completion.json(), "CreateCompletionResponse")


def test_sagemaker_chat_stream_is_openai_sse(http):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with http.stream("POST", "/invocations", json=body) as response:
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    openai_spec.validate(events[0], "CreateChatCompletionStreamResponse")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"inputs": "x", "parameters": {"mirostat": 2}}, "parameters.mirostat"),
        ({"inputs": 3}, "inputs"),
        ({"inputs": ["a", "b"], "stream": True}, "inputs"),
        ({"question": "x"}, "inputs"),
    ],
)
def test_sagemaker_bad_input_is_400(http, body, param):
    assert assert_error_envelope(http.post("/invocations", json=body), 400)["param"] == param


# -- Databricks ------------------------------------------------------------------------------


def databricks(http, name, body):
    return http.post(f"/serving-endpoints/{name}/invocations", json=body)


def test_databricks_chat(http):
    messages = [{"role": "user", "content": "What is a mixture of experts model?"}]
    response = databricks(http, CHAT_MODEL, {"messages": messages, "max_tokens": 12, "temperature": 0})
    assert response.status_code == 200, response.text
    openai_spec.validate(response.json(), "CreateChatCompletionResponse")
    assert response.json()["choices"][0]["message"]["content"] == greedy_chat(http, messages)


def test_databricks_raw_prompt_is_a_plain_completion(http):
    body = {"prompt": "The license", "max_tokens": 12, "temperature": 0, "use_raw_prompt": True}
    response = databricks(http, CHAT_MODEL, body)
    assert response.status_code == 200, response.text
    openai_spec.validate(response.json(), "CreateCompletionResponse")
    assert response.json()["choices"][0]["text"] == greedy_completion(http, "The license")


def test_databricks_default_prompt_goes_through_the_chat_template(http):
    body = {"prompt": "The license", "max_tokens": 12, "temperature": 0}
    response = databricks(http, CHAT_MODEL, body)
    assert response.status_code == 200, response.text
    completion = response.json()
    openai_spec.validate(completion, "CreateCompletionResponse")
    assert completion["object"] == "text_completion"
    assert completion["choices"][0]["text"] == greedy_chat(http, [{"role": "user", "content": "The license"}])
    echoed = databricks(http, CHAT_MODEL, {**body, "echo": True}).json()["choices"][0]["text"]
    assert echoed == "The license" + completion["choices"][0]["text"]


def test_databricks_templated_completion_streams_as_completion_chunks(http):
    body = {"prompt": "The license", "max_tokens": 12, "temperature": 0, "stream": True}
    with http.stream("POST", f"/serving-endpoints/{CHAT_MODEL}/invocations", json=body) as response:
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(chunk["object"] == "text_completion" for chunk in chunks)
    text = "".join(choice["text"] for chunk in chunks for choice in chunk["choices"])
    assert text == greedy_chat(http, [{"role": "user", "content": "The license"}])


def chat_usage(http, prompt: str, max_tokens: int) -> dict:
    body = {
        "model": CHAT_MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


PROMPTS = ["The license", "Tell me about Paris", "Why?"]


def test_databricks_prompt_list_is_one_choice_per_prompt_each_through_the_chat_template(base_url, redis_server, redis):
    # "multiple independent prompts in one request", use_raw_prompt left at its default (false)
    key_id, secret = create_key(redis_server.url, "databricks-batch")
    with httpx.Client(base_url=base_url, timeout=60, headers={"authorization": f"Bearer {secret}"}) as http:
        response = databricks(http, CHAT_MODEL, {"prompt": PROMPTS, "max_tokens": 8, "temperature": 0})
        assert response.status_code == 200, response.text
        completion = response.json()
        openai_spec.validate(completion, "CreateCompletionResponse")
        alone = [chat_usage(http, prompt, 8) for prompt in PROMPTS]
    assert [choice["index"] for choice in completion["choices"]] == [0, 1, 2]
    assert [choice["text"] for choice in completion["choices"]] == [
        a["choices"][0]["message"]["content"] for a in alone
    ]
    usage = completion["usage"]  # every prompt counted, as each alone through chat
    assert usage["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert usage["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone)
    # ... and charged so: the batch's request record holds the batch's usage
    found = {(int(r["prompt_tokens"]), int(r["completion_tokens"])) for r in wait_until_settled(redis, key_id)}
    assert (usage["prompt_tokens"], usage["completion_tokens"]) in found


def test_databricks_prompt_list_streams_every_choice_with_its_suffix_and_echo(http):
    body = {"prompt": PROMPTS[:2], "max_tokens": 6, "temperature": 0, "stream": True, "suffix": " [end]", "echo": True}
    with http.stream("POST", f"/serving-endpoints/{CHAT_MODEL}/invocations", json=body) as response:
        assert response.status_code == 200, response.read()
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    texts = {0: "", 1: ""}
    for event in events[:-1]:
        chunk = json.loads(event)
        assert chunk["object"] == "text_completion"
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
    for index, prompt in enumerate(PROMPTS[:2]):
        answer = chat_usage(http, prompt, 6)["choices"][0]["message"]["content"]
        assert texts[index] == prompt + answer + " [end]"


@pytest.mark.parametrize("raw", [False, True])
def test_databricks_suffix_is_appended_to_each_completion(http, raw):
    # n=2 needs sampling (vLLM refuses it greedy); a seed makes the plain request draw the same
    body = {
        "prompt": ["The license", "Why?"],
        "max_tokens": 5,
        "temperature": 1.0,
        "seed": 11,
        "suffix": "<|end|>",
        "n": 2,
        "use_raw_prompt": raw,
    }
    response = databricks(http, CHAT_MODEL, body)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 4 and all(choice["text"].endswith("<|end|>") for choice in choices)
    plain = databricks(http, CHAT_MODEL, {**body, "suffix": None}).json()["choices"]
    assert [c["text"] for c in choices] == [c["text"] + "<|end|>" for c in plain]


def test_databricks_error_behavior(http):
    long = "license " * 2100
    error = assert_error_envelope(
        databricks(http, CHAT_MODEL, {"prompt": long, "max_tokens": 8, "use_raw_prompt": True}), 400
    )
    assert "2048" in error["message"]
    body = {"prompt": long, "max_tokens": 8, "use_raw_prompt": True, "error_behavior": "truncate"}
    response = databricks(http, CHAT_MODEL, body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 2048 - 8
    assert_error_envelope(databricks(http, CHAT_MODEL, {**body, "error_behavior": "sometimes"}), 400)


def test_databricks_embeddings_with_instruction(http):
    instruction = "Represent this sentence for searching relevant passages:"
    response = databricks(http, EMBEDDING_MODEL, {"input": ["a red car"], "instruction": instruction})
    assert response.status_code == 200, response.text
    openai_spec.validate(response.json(), "CreateEmbeddingResponse")
    direct = http.post("/v1/embeddings", json={"model": EMBEDDING_MODEL, "input": [f"{instruction} a red car"]})
    plain = http.post("/v1/embeddings", json={"model": EMBEDDING_MODEL, "input": ["a red car"]})
    vector = response.json()["data"][0]["embedding"]
    assert vector == pytest.approx(direct.json()["data"][0]["embedding"], abs=1e-6)
    assert vector != pytest.approx(plain.json()["data"][0]["embedding"], abs=1e-3)


def test_databricks_openai_client_base_url(base_url, api_key):
    client = openai.OpenAI(base_url=f"{base_url}/serving-endpoints", api_key=api_key, max_retries=0)
    reply = client.chat.completions.create(model=CHAT_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert reply.usage.completion_tokens <= 3


def test_databricks_unknown_endpoint_is_404(http):
    error = assert_error_envelope(
        databricks(http, "no-such-endpoint", {"messages": [{"role": "user", "content": "x"}]}), 404
    )
    assert error["code"] == "model_not_found"


# -- OpenVINO Model Server (/v3) ---------------------------------------------------------------


def test_ovms_v3_prefix(base_url, api_key, http):
    client = openai.OpenAI(base_url=f"{base_url}/v3", api_key=api_key, max_retries=0)
    assert [model.id for model in client.models.list().data] == [CHAT_MODEL, EMBEDDING_MODEL, RERANKER["name"]]
    assert client.models.retrieve(EMBEDDING_MODEL).id == EMBEDDING_MODEL
    chat = client.chat.completions.create(
        model=CHAT_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12, temperature=0
    )
    assert chat.choices[0].message.content == greedy_chat(http, [{"role": "user", "content": "hi"}])
    assert client.completions.create(model=CHAT_MODEL, prompt="The license", max_tokens=12, temperature=0).choices[
        0
    ].text == greedy_completion(http, "The license")
    assert len(client.embeddings.create(model=EMBEDDING_MODEL, input="hi").data[0].embedding) == 384


# -- Jan / llama.cpp parameter names ----------------------------------------------------------------


def test_llamacpp_parameter_names_are_honoured(http):
    messages = [{"role": "user", "content": "Tell me about the license."}]
    base = {"model": CHAT_MODEL, "messages": messages, "max_tokens": 24, "temperature": 0}
    # As Jan sends them: llama.cpp's names beside OpenAI's.
    jan = {**base, "repeat_penalty": 1.5, "repeat_last_n": 64, "top_k": 40, "min_p": 0.05, "cache_prompt": True}
    vllm = {**base, "repetition_penalty": 1.5, "top_k": 40, "min_p": 0.05}
    ours = http.post("/v1/chat/completions", json=jan)
    assert ours.status_code == 200, ours.text
    same = http.post("/v1/chat/completions", json=vllm).json()["choices"][0]["message"]["content"]
    assert ours.json()["choices"][0]["message"]["content"] == same
    assert same != greedy_chat(http, messages, 24)  # the penalty changed the output


@pytest.mark.parametrize("params, param", [({"mirostat": 2}, "mirostat"), ({"tfs_z": 0.5}, "tfs_z")])
def test_llamacpp_samplers_we_lack_are_400(http, params, param):
    body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "x"}], **params}
    assert assert_error_envelope(http.post("/v1/chat/completions", json=body), 400)["param"] == param
