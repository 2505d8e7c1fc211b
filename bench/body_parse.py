"""What an admitted body costs the event loop before it reaches the engine, by shape
(docs/quotas.md, "Work before admission").

The gateway's loop (the ingress', or on a direct route the model replica's, which
relays every stream of that replica) parses a request's body, checks it and hands
it to vLLM's request model, all under the GIL: a thread would not move the work, and
a process would hand back the same objects to unpickle. The cost is per JSON value,
not per byte, so the bound is on values: ``MAX_JSON_VALUES`` (counted before the parse)
and, for chat, no more messages than the model's context has tokens.

Per shape, the milliseconds of each stage the loop runs, in this process, the best of
``--repeats`` (the least the loop spends; no server: pure CPU, this box's noise aside):

- ``parse``: ``parse_json_object`` (the pre-parse count, json.loads, the depth and
  surrogate checks), or the 400 it answers;
- ``envelope``: the gateway's own validation of the operation's shape;
- ``vllm``: vLLM's request model (``ChatCompletionRequest`` / ``CompletionRequest``),
  what the replica runs next; ``-`` where the gateway refused the body already.

    python bench/body_parse.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from serve_app.errors import OpenAIError  # noqa: E402
from serve_app.wire.api_requests import OPERATIONS, parse_json_object, validate_request  # noqa: E402

try:
    from serve_app.wire.api_requests import MAX_JSON_VALUES, check_message_count
except ImportError:  # a tree from before the bounds (git worktree of an older commit): same shapes, no checks
    MAX_JSON_VALUES = 524_288

    def check_message_count(messages, context_length, param="messages") -> None:
        return None


MiB = 1 << 20
BODY_LIMIT = 8 * MiB
CONTEXT = 2048  # the demo chat model's


def messages_body(count: int) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "a"}] * count}).encode()


def shapes() -> dict[str, tuple[str, bytes]]:
    """name: (operation, body). Each 8 MiB shape is the densest of its kind the body
    limit lets through; each ``at the bound`` one the densest the value bound does."""
    per_message = len(b'{"role":"user","content":"a"}, ')
    at_bound = MAX_JSON_VALUES // 3 - 10  # a message is 3 values: its object, its 2 members
    return {
        "8 MiB of text": (
            "chat",
            json.dumps(
                {"model": "m", "messages": [{"role": "user", "content": "word " * (BODY_LIMIT // 5 - 20)}]}
            ).encode(),
        ),
        "8 MiB of 1-letter messages": ("chat", messages_body(BODY_LIMIT // per_message)),
        "1-letter messages, at the bound": ("chat", messages_body(at_bound)),
        "as many as the context": ("chat", messages_body(CONTEXT)),
        "8 MiB of [] items": ("completions", b'{"model":"m","prompt":"x","x":[' + b"[]," * (BODY_LIMIT // 3) + b"[]]}"),
        "[] items, at the bound": (
            "completions",
            b'{"model":"m","prompt":"x","x":[' + b"[]," * (MAX_JSON_VALUES // 2 - 10) + b"[]]}",
        ),
        "8 MiB of token ids": ("completions", json.dumps({"model": "m", "prompt": [7] * (BODY_LIMIT // 3)}).encode()),
        "token ids, at the bound": (
            "completions",
            json.dumps({"model": "m", "prompt": [7] * (MAX_JSON_VALUES - 10)}).encode(),
        ),
    }


def best_ms(run, repeats: int):
    best, result = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        try:
            result = run()
        except OpenAIError as exc:
            result = exc
        best = min(best, time.perf_counter() - started)
    return best * 1e3, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    vllm_models = {"chat": ChatCompletionRequest, "completions": CompletionRequest}
    print(f"MAX_JSON_VALUES {MAX_JSON_VALUES:,}; context {CONTEXT}; best of {args.repeats}\n")
    print("| shape | body | parse ms | envelope ms | vllm ms | answer |\n|---|---:|---:|---:|---:|---|")
    for name, (operation, raw) in shapes().items():
        parse_ms, body = best_ms(partial(parse_json_object, raw), args.repeats)
        envelope_ms = vllm_ms = None
        answer = "admitted to vLLM"
        if isinstance(body, OpenAIError):
            answer = f"400 {body.code}"
        else:
            envelope_ms, checked = best_ms(partial(validate_request, OPERATIONS[operation], body), args.repeats)
            if not isinstance(checked, OpenAIError):
                _, checked = best_ms(partial(check_message_count, body.get("messages"), CONTEXT), 1)
            if isinstance(checked, OpenAIError):
                answer = f"400 {checked.code}"
            else:
                model = vllm_models[operation]
                known = {name: value for name, value in body.items() if name in model.model_fields}
                vllm_ms, _ = best_ms(partial(model.model_validate, known), args.repeats)
        cells = [f"{ms:.1f}" if ms is not None else "-" for ms in (parse_ms, envelope_ms, vllm_ms)]
        print(f"| {name} | {len(raw) / MiB:.2f} MiB | {' | '.join(cells)} | {answer} |")


if __name__ == "__main__":
    main()
