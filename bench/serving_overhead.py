"""Gateway overhead: bare `vllm serve` vs this stack, same model, same load, one run.

For each target (bare vLLM, then the Serve stack), start it, drive it with
`vllm bench serve` (random dataset, the model's local tokenizer, ignore_eos so
every request makes the same number of tokens) at each concurrency, stop it.
Targets run one after the other, never side by side: on a 2-core box they
would steal each other's CPU. With --repeats N the whole sequence repeats and
every figure is the median over repeats. Prints one table: TTFT p50/p99,
TPOT p50, output tokens/s per target and the stack/vLLM ratios.

    python bench/serving_overhead.py [--concurrency 1 32] [--num-prompts 64] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from contract.model_config import ModelConfig  # noqa: E402
from replicas.sources import resolve_source  # noqa: E402
from replicas.vllm_replica import vllm_serve_command  # noqa: E402

METRICS = [
    ("median_ttft_ms", "TTFT p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("median_tpot_ms", "TPOT p50 ms"),
    ("output_throughput", "output tok/s"),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bench_api_key() -> str:
    """An unlimited key in the stack's Redis (REDIS_URL) for the load generator."""
    import asyncio

    import redis.asyncio

    from serve_app.keys import KeyStore

    async def create() -> str:
        client = redis.asyncio.Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
        try:
            return (await KeyStore(client).create(f"bench-{time.time_ns()}"))[1]
        finally:
            await client.aclose()

    return asyncio.run(create())


def wait_ready(url: str, proc: subprocess.Popen, model: str, timeout_s: float = 600) -> None:
    """Up means a real completion came back, not just /v1/models."""
    deadline = time.monotonic() + timeout_s
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            headers = {"authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
            if httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=30).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("server did not come up")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def bare_vllm(config: ModelConfig, source: str, log: Path):
    port = free_port()
    cmd = vllm_serve_command(config, source, "127.0.0.1", port)
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env={**os.environ, **config.env}, stdout=out, stderr=out, cwd=REPO)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, config.name)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


@contextmanager
def serve_stack(serve_config: dict, log: Path, env: dict[str, str]):
    port = free_port()
    serve_config = {**serve_config, "http_options": {**serve_config.get("http_options", {}), "port": port}}
    config_file = log.with_suffix(".yaml")
    config_file.write_text(yaml.safe_dump(serve_config))
    serve_bin = Path(sys.executable).with_name("serve")
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(serve_bin), "run", str(config_file)],
            env={**os.environ, **env}, stdout=out, stderr=out, cwd=REPO,
        )
    try:
        model = serve_config["applications"][0]["args"]["models"][0]["name"]
        wait_ready(f"http://127.0.0.1:{port}", proc, model)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


def run_load(url: str, config: ModelConfig, source: str, concurrency: int, args, out_dir: Path) -> dict:
    name = f"c{concurrency}-{time.monotonic_ns()}.json"
    cmd = [
        sys.executable, "-m", "replicas.vllm_cli", "bench", "serve",
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
        "--base-url", url, "--model", source, "--served-model-name", config.name,
        "--tokenizer", source, "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(max(args.num_prompts, concurrency * 2)),
        "--max-concurrency", str(concurrency), "--request-rate", "inf", "--ignore-eos",
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
        "--seed", "0", "--disable-tqdm",
        "--save-result", "--result-dir", str(out_dir), "--result-filename", name,
    ]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return json.loads((out_dir / name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "local.yaml")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    parser.add_argument("--stack-env", nargs="*", default=[], metavar="KEY=VALUE",
                        help="extra environment for the stack (e.g. Ray Serve knobs)")
    parser.add_argument("--batch-ms", type=float, help="override stream_batch_interval_ms")
    args = parser.parse_args()

    serve_config = yaml.safe_load(args.config.read_text())
    if args.batch_ms is not None:
        serve_config["applications"][0]["args"]["models"][0]["stream_batch_interval_ms"] = args.batch_ms
    stack_env = dict(item.split("=", 1) for item in args.stack_env)
    # vllm bench (and wait_ready) send it as a Bearer token; bare vLLM ignores it.
    os.environ["OPENAI_API_KEY"] = bench_api_key()
    config = ModelConfig(**serve_config["applications"][0]["args"]["models"][0])
    source = resolve_source(config)
    results: dict[tuple[str, int], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        out_dir = Path(tmp)
        for _ in range(args.repeats):
            for target, start in (
                ("vllm", lambda: bare_vllm(config, source, out_dir / "vllm.log")),
                ("stack", lambda: serve_stack(serve_config, out_dir / "stack.log", stack_env)),
            ):
                with start() as url:
                    run_load(url, config, source, 1, args, out_dir)  # warm-up, discarded
                    for concurrency in args.concurrency:
                        results.setdefault((target, concurrency), []).append(
                            run_load(url, config, source, concurrency, args, out_dir)
                        )

    def median(target: str, concurrency: int, key: str) -> float:
        return statistics.median(r[key] for r in results[(target, concurrency)])

    print(f"\nmodel {config.name}; input {args.input_len} tok, output {args.output_len} tok, "
          f"{args.num_prompts}+ prompts per point, median of {args.repeats} repeat(s)\n")
    print(f"{'conc':>4}  {'metric':<14}{'vllm':>10}{'stack':>10}{'stack/vllm':>12}{'stack-vllm':>12}")
    raw = []
    for concurrency in args.concurrency:
        for key, label in METRICS:
            ours, theirs = median("stack", concurrency, key), median("vllm", concurrency, key)
            raw.append({"concurrency": concurrency, "metric": key, "vllm": theirs, "stack": ours})
            print(f"{concurrency:>4}  {label:<14}{theirs:>10.2f}{ours:>10.2f}"
                  f"{ours / theirs:>12.3f}{ours - theirs:>12.2f}")
    if args.json:
        args.json.write_text(json.dumps(raw, indent=2))


if __name__ == "__main__":
    main()
