"""Through `dflash-cli serve` against the engine alone, same process, same prompts, same pair (the demo).

For each prompt: the engine's own generate() (decode tok/s and time to first token from its statistics),
then the same request streamed through the OpenAI-compatible server with the official openai client
(decode tok/s and time to first token measured by the client, from the request to the first text and
from there to the last). Greedy, a fixed block, prompts alternated. Prints a table and the ratios.

    .venv/bin/python benchmarks/serve_bench.py [--prompts 6] [--max-tokens 128] [--model demo]
"""

from __future__ import annotations

import argparse
import platform
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

PROMPTS = ["What is 17 times 23? Explain step by step.", "Write a short poem about the sea.",
           "List three uses of a hash map.", "Explain what a KV cache is in one paragraph.",
           "What is the capital of France, and why is it famous?", "Solve: 3x + 7 = 22."]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--model", default="demo")
    args = parser.parse_args()

    import openai
    import uvicorn

    from dflash_cli.conversation import GenerationSettings
    from dflash_cli.engine.device import cpu_capability
    from dflash_cli.engine.generate import generate
    from dflash_cli.engine.text import encode_prompt
    from dflash_cli.models.resolve import resolve_pair
    from dflash_cli.runtime.local import load_runtime
    from dflash_cli.server.app import ServerState, make_app
    from dflash_cli.server.worker import EngineWorker

    pair = resolve_pair(args.model, None, no_draft=False, quant=None)
    runtime = load_runtime(str(pair.target_dir), str(pair.drafter_dir), quant=pair.quant, quant_auto=pair.quant_auto)
    block = runtime.drafter.block_size
    defaults = GenerationSettings(max_tokens=args.max_tokens, temperature=0.0, top_p=1.0, top_k=0, block_size=block)
    worker = EngineWorker(runtime).start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(uvicorn.Config(make_app(ServerState(worker, args.model, api_key=None, defaults=defaults,
                                                                max_tokens_cap=4096)), log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="none", max_retries=0)

    rows = []
    prompts = (PROMPTS * (1 + args.prompts // len(PROMPTS)))[: args.prompts]
    for text in [prompts[0]] + prompts:  # the first round warms both paths and is not kept
        messages = [{"role": "user", "content": text}]
        ids = encode_prompt(runtime.tokenizer, messages)
        engine = generate(runtime.target, runtime.drafter, ids, tokenizer=runtime.tokenizer,
                          max_new_tokens=args.max_tokens, block_size=block).stats
        t0 = time.perf_counter()
        first = last = None
        tokens = 0
        for chunk in client.chat.completions.create(model=args.model, messages=messages, stream=True,
                                                    max_tokens=args.max_tokens, stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                last = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        assert first is not None and last is not None
        rows.append((engine.time_to_first_token, first - t0, engine.generated_tokens / (engine.prefill_seconds
                     + engine.decode_seconds), tokens / (last - t0), engine.decode_tokens_per_second,
                     (tokens - 1) / (last - first) if last > first else 0.0))
    rows = rows[1:]
    server.should_exit = True
    worker.stop()
    cap = cpu_capability()
    print(f"# serve vs engine: {args.model}, {args.prompts} prompts x {args.max_tokens} tokens, greedy, block {block}; "
          f"{platform.processor() or platform.machine()}, torch CPU capability {cap}")
    print("| prompt | engine TTFT ms | served TTFT ms | engine decode tok/s | served decode tok/s |")
    print("|---|---|---|---|---|")
    for i, (e_ttft, s_ttft, _, _, e_rate, s_rate) in enumerate(rows):
        print(f"| {i + 1} | {1e3 * e_ttft:.1f} | {1e3 * s_ttft:.1f} | {e_rate:.1f} | {s_rate:.1f} |")
    e_ttft, s_ttft = (statistics.median(r[k] for r in rows) for k in (0, 1))
    e_rate, s_rate = (statistics.median(r[k] for r in rows) for k in (4, 5))
    print(f"| median | {1e3 * e_ttft:.1f} | {1e3 * s_ttft:.1f} | {e_rate:.1f} | {s_rate:.1f} |")
    print(f"\nserved decode rate / engine: {s_rate / e_rate:.3f}x; served TTFT - engine TTFT: "
          f"{1e3 * (s_ttft - e_ttft):+.1f} ms (client-side: HTTP, JSON and SSE included)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
