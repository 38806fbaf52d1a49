"""The server command that runs a registry pair on vLLM or SGLang with its DFlash drafter (`serve-cmd`).

Pure data -> argv: nothing is imported from the engines, nothing is run here. The flags were checked
against the engines' DFlash documentation and source (see README, "When one GPU is not enough"):

- vLLM: `vllm serve TARGET --speculative-config '{"method": "dflash", "model": DRAFTER,
  "num_speculative_tokens": B - 1}'`: a DFlash block is one anchor token plus B - 1 drafted ones (the
  z-lab model cards give 15 for the 16-token drafters), and `--per-request-spec-decode-metrics summary`
  (vLLM 0.29 and later) so that each response carries its own `metrics.speculative_decoding`, which
  `--engine` reads in place of the server-wide /metrics counters.
- SGLang: `python3 -m sglang.launch_server --model-path TARGET --speculative-algorithm DFLASH
  --speculative-draft-model-path DRAFTER --speculative-num-draft-tokens B`: for DFLASH SGLang counts the
  whole block (its server args derive `speculative_num_steps = B - 1` from it; z-lab's example passes 16),
  and hybrid Qwen3.5/3.6 and Qwen3-Next targets (Gated DeltaNet state) need
  `--mamba-scheduler-strategy extra_buffer` (SGLang's mamba cache strategy compatible with speculative
  decoding).
- Both: `--trust-remote-code` for targets whose tokenizer is code in their repo (Kimi K2.5; registry
  `trust_remote_code`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ENGINES = ("vllm", "sglang")
# What --exec needs on PATH, and what to install when it is missing.
EXECUTABLES = {"vllm": "vllm", "sglang": "python3"}
INSTALL = {"vllm": "pip install vllm (0.29 or later: the dflash method and per-request acceptance metrics)",
           "sglang": "pip install sglang (a release with --speculative-algorithm DFLASH)"}
# Target repo names (lower case, without the org) of hybrid targets whose linear-attention state SGLang's
# scheduler must keep in an extra buffer for speculative decoding.
SGLANG_HYBRID_PREFIXES = ("qwen3.5-", "qwen3.6-", "qwen3-next-", "qwen3-coder-next")


@dataclass(frozen=True)
class ServePair:
    name: str
    target: str
    drafter: str
    block_size: int
    trust_remote_code: bool = False


def is_sglang_hybrid(target: str) -> bool:
    return target.rsplit("/", 1)[-1].lower().startswith(SGLANG_HYBRID_PREFIXES)


def server_argv(pair: ServePair, engine: str, tp: int = 1, port: int | None = None) -> list[str]:
    """The engine's launch command for the pair, as an argv list."""
    if engine == "vllm":
        spec = {"method": "dflash", "model": pair.drafter, "num_speculative_tokens": pair.block_size - 1}
        argv = ["vllm", "serve", pair.target, "--tensor-parallel-size", str(tp),
                "--speculative-config", json.dumps(spec), "--per-request-spec-decode-metrics", "summary"]
    elif engine == "sglang":
        argv = ["python3", "-m", "sglang.launch_server", "--model-path", pair.target, "--tp-size", str(tp),
                "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", pair.drafter,
                "--speculative-num-draft-tokens", str(pair.block_size)]
        if is_sglang_hybrid(pair.target):
            argv += ["--mamba-scheduler-strategy", "extra_buffer"]
    else:
        raise ValueError(f"unknown engine {engine!r}")
    if pair.trust_remote_code:
        argv.append("--trust-remote-code")
    if port is not None:
        argv += ["--port", str(port)]
    return argv
