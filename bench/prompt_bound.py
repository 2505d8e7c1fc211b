"""What bounding every prompt by its reservation costs (docs/quotas.md, "The reservation
bounds every prompt").

The count is vLLM's own: the replica's renderer (chat template, tokenizer) runs for
every request anyway, and replicas/prompt_allowance.py only adds up what it rendered.
So the figures that matter are (1) what that adding costs on every request, (2) how
often the gateway's 4-bytes-a-token estimate is too low, per script, and (3) what
such a request pays: a second rendering (measured here, per KB), and its first
admission withdrawn and a second one made in Redis (two round trips:
bench/admission_throughput.py). Runs vLLM's
renderer for the demo model in this process (no engine, no Ray), CPU time of this
thread, medians over repeats; prints one table.

    python bench/prompt_bound.py [--sizes 1 4 16] [--repeats 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# One KB of each, as a tenant would send it (UTF-8 bytes), repeated to the size asked.
SCRIPTS = {
    "English prose": "The licensor grants you a worldwide, royalty-free license to use the work. ",
    "Python code": "def total(items):\n    return sum(item.price * item.qty for item in items if item)\n",
    "emoji": "😀🎉🚀💡🔥👩‍💻🏳️‍🌈✨",
    "CJK": "漢字仮名交じり文中文日本語한국어",
    "Tamil": "தமிழ்நாடுசென்னை",
    "punctuation": "!?!?!?..;;",
    "digits": "0123456789",
}
MAX_MODEL_LEN = 65536  # past the demo model's own 2,048, so 16 KB of dense text fits


def text_of(script: str, kilobytes: int) -> str:
    unit, out = SCRIPTS[script], ""
    while len(out.encode()) < kilobytes * 1024:
        out += unit
    return out


def renderer_for_demo():
    """vLLM's renderer of the demo model, wrapped as the replica wraps it; and its length function."""
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    from vllm.renderers.inputs.preprocess import extract_prompt_len
    from vllm.renderers.registry import renderer_from_config

    from contract.model_config import ModelConfig
    from replicas.vllm_engine import engine_config

    _, _, vllm_config = engine_config(
        ModelConfig(name="m", source="demo", engine_kwargs={"max_model_len": MAX_MODEL_LEN})
    )
    plain = renderer_from_config(vllm_config)
    return (
        plain,
        vllm_config.model_config,
        lambda engine_input: extract_prompt_len(vllm_config.model_config, engine_input),
    )


def render_chat(renderer, model_config, body):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    request = ChatCompletionRequest.model_validate(body)
    _, inputs = renderer.render_chat(
        [request.messages], request.build_chat_params(None, "auto"), request.build_tok_params(model_config)
    )
    return inputs


def cpu_us(call, repeats: int) -> float:
    """Median CPU time of ``call()`` in this thread, µs."""
    times = []
    for _ in range(repeats):
        started = time.thread_time_ns()
        call()
        times.append((time.thread_time_ns() - started) / 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16], help="prompt sizes, KB of UTF-8")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()

    from replicas.prompt_allowance import allowing, count_rendered
    from serve_app.wire.reservation import reserve

    renderer, model_config, length = renderer_for_demo()
    rows = []
    for script in SCRIPTS:
        for size in args.sizes:
            body = {"model": "m", "messages": [{"role": "user", "content": text_of(script, size)}], "max_tokens": 16}
            raw = len(json.dumps(body, ensure_ascii=False).encode())
            estimate = reserve("chat", dict(body), raw, default_max_tokens=16, context_length=MAX_MODEL_LEN).prompt
            inputs = render_chat(renderer, model_config, body)
            tokens = sum(length(engine_input) for engine_input in inputs)
            render_us = cpu_us(lambda body=body: render_chat(renderer, model_config, body), args.repeats)

            def counted(tokens=tokens, inputs=inputs):
                with allowing(tokens):
                    count_rendered(inputs, length)

            count_us = cpu_us(counted, args.repeats * 10)
            rows.append((script, size, raw, estimate, tokens, render_us, count_us))

    print(
        f"vLLM renderer of the demo model (byte-level BPE, ChatML), chat of one user message; "
        f"CPU time of this thread, medians of {args.repeats} (the count: of {args.repeats * 10})"
    )
    print(
        f"{'script':<14} {'KB':>3} {'body B':>7} {'estimate':>8} {'engine':>7} {'ratio':>6} {'resize':>6} "
        f"{'render µs':>9} {'µs/KB':>7} {'count µs':>8}"
    )
    for script, size, raw, estimate, tokens, render_us, count_us in rows:
        print(
            f"{script:<14} {size:>3} {raw:>7} {estimate:>8} {tokens:>7} {tokens / estimate:>6.2f} "
            f"{'yes' if tokens > estimate else 'no':>6} {render_us:>9.0f} {render_us / size:>7.0f} {count_us:>8.2f}"
        )
    print(
        "ratio: engine tokens / estimate; resize: the replica refuses it at its estimate and the gateway "
        "admits it again (a second rendering, as 'render µs', and two Redis round trips)."
    )


if __name__ == "__main__":
    main()
