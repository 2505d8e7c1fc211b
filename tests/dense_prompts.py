"""Token-dense prompts and a burst of them, as a hostile tenant sends them: text whose
every character is several tokens of the demo tokenizer (byte-level BPE trained on
LICENSE, ASCII words) and few bytes of JSON, so that the gateway's estimate of 4 bytes
of body a token is far below what the engine counts (docs/quotas.md, "The
reservation bounds every prompt")."""

from __future__ import annotations

import json
import random
import threading

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


def burst(
    base_url: str,
    secrets: list[str],
    prompts: list[str],
    max_tokens: int,
    model: str,
    stream: bool = False,
    clients: int = CLIENTS,
) -> list:
    """``clients`` chats sent at once (client i with secrets[i % len] and prompts[i % len]);
    the usage of each one answered (a 429 is left out)."""
    answered, lock, go = [], threading.Lock(), threading.Barrier(clients)

    def one(i: int) -> None:
        client = openai.OpenAI(base_url=base_url + "/v1", api_key=secrets[i % len(secrets)], max_retries=0, timeout=180)
        messages = [{"role": "user", "content": prompts[i % len(prompts)]}]
        go.wait()
        try:
            if stream:
                chunks = client.chat.completions.create(
                    model=model,
                    messages=messages,
                    max_tokens=max_tokens,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                usage = [chunk.usage for chunk in chunks if chunk.usage][-1]
            else:
                usage = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens).usage
        except openai.RateLimitError:
            return
        with lock:
            answered.append(usage)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    return answered
