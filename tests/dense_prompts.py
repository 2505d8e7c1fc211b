"""Token-dense prompts and a burst of them, as a hostile tenant sends them: text whose
every character is several tokens of the demo tokenizer (byte-level BPE trained on
LICENSE, ASCII words) and few bytes of JSON, so that the gateway's estimate of 4 bytes
of body a token is far below what the engine counts (docs/quotas.md, "The
reservation bounds every prompt")."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import openai

SCRIPTS = {
    "emoji": "😀🎉🚀💡🔥🧪🦀👩‍💻🏳️‍🌈✨",
    "cjk": "漢字仮名交じり文中文日本語한국어",
    "tamil": "தமிழ்நாடுசென்னைகோயம்புத்தூர்",
    "punctuation": "!?!?!?!?",
    "digits": "0123456789",
}
CLIENTS = 16


def dense(script: str, chars: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(SCRIPTS[script]) for _ in range(chars))


def estimate(prompt: str) -> int:
    """About what the gateway reserves for ``prompt`` before the replica counts it:
    4 bytes of body a token, the body as the SDK sends it (JSON, non-ASCII escaped),
    with room for the fields around it."""
    return (len(json.dumps(prompt)) + 200) // 4


BURST_TIMEOUT_S = 300  # what a burst's clients get, all together, to be answered


def chat(model: str, max_tokens: int, stream: bool = False) -> Callable[[openai.OpenAI, Any], Any]:
    """A sender for ``burst``: one chat of the prompt, its usage."""

    def send(client: openai.OpenAI, prompt: Any):
        messages = [{"role": "user", "content": prompt}]
        if stream:
            options = {"include_usage": True}
            chunks = client.chat.completions.create(
                model=model, messages=messages, max_tokens=max_tokens, stream=True, stream_options=options
            )
            return [chunk.usage for chunk in chunks if chunk.usage][-1]
        return client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens).usage

    return send


def burst(
    base_url: str,
    secrets: list[str],
    prompts: list,
    max_tokens: int = 0,
    model: str = "",
    stream: bool = False,
    clients: int = CLIENTS,
    send: Callable[[openai.OpenAI, Any], Any] | None = None,
) -> list:
    """``clients`` requests sent at once (client i with secrets[i % len] and prompts[i % len]):
    chats of ``model`` by default, else what ``send(client, prompt)`` sends; the usage of
    each one answered. A 429 (the limit under test refusing) is left out;
    any other outcome fails the caller: a 5xx, a 4xx that is not a 429, a timeout, a
    connection error, a stream without usage, or a client still waiting at the bound."""
    answered, failed, lock, go = [], [], threading.Lock(), threading.Barrier(clients)
    send = send or chat(model, max_tokens, stream)

    def one(i: int) -> None:
        client = openai.OpenAI(base_url=base_url + "/v1", api_key=secrets[i % len(secrets)], max_retries=0, timeout=180)
        try:
            go.wait(timeout=60)
            usage = send(client, prompts[i % len(prompts)])
            assert usage is not None, "an answer without usage"
        except openai.RateLimitError:
            return
        except BaseException as error:  # noqa: BLE001 (each client's failure is reported, not lost with its thread)
            with lock:
                failed.append(f"client {i}: {type(error).__name__}: {error}")
            return
        with lock:
            answered.append(usage)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + BURST_TIMEOUT_S
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    waiting = sum(thread.is_alive() for thread in threads)
    assert not waiting, f"{waiting} of {clients} clients still unanswered after {BURST_TIMEOUT_S} s"
    assert not failed, f"{len(failed)} of {clients} clients failed other than with a 429: {failed}"
    return answered
