#!/usr/bin/env python
"""Benchmark the DFlash engine on a target + drafter with random weights built in memory.

Measures unit costs (decode 1 token, verify B, draft B), plain decoding, speculative decoding with a
random drafter (tau ~ 1, the overhead case) and with OracleDrafter at chosen tau, the split of a step
into draft / verify / loop overhead, peak memory, and transformers' own generate() (plain, assisted, and
its speculation_type="dflash" path) as an outside baseline. Tables go to stdout, progress to stderr;
--json FILE writes every number.

The target's weights are random except that, by default (--init successor), its embedding and lm_head
plant a fixed successor permutation: greedy output then follows a long non-repeating cycle with a wide
logit margin, so a block verify and a 1-token decode pick the same token even in bf16 and the oracle's
reference stays valid. Timings do not depend on the weights' values.

Examples:
    python benchmarks/bench_engine.py --quick
    python benchmarks/bench_engine.py --threads 1           # cpu-small preset, about 2 minutes
    python benchmarks/bench_engine.py --preset qwen3-8b --device cuda --dtype bfloat16 --json out.json
    python benchmarks/bench_engine.py --preset qwen3-8b --device cuda --dtype bfloat16 --quant nf4
    python benchmarks/bench_engine.py --preset qwen3-1.7b --quant q4a8 --prompts 1 --new-tokens 64 --taus 4 6.5

CPU formats (--quant q4/q8/q4a8/q8a8) run on the fast path only, with the drafter's linears q8a8 under
q4a8/q8a8 as the CLI runs them, and report the process's resident memory before and after the fast path
is built beside what the quantized target holds (its codes and scales, the dense tensors left, the caches).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from dflash_cli.engine.compile import compiler_for
from dflash_cli.engine.device import peak_memory, pick_dtype, reset_peak_memory, synchronize
from dflash_cli.engine.drafter import DFlashDrafter, DrafterConfig
from dflash_cli.engine.generate import generate
from dflash_cli.engine.load import attach_drafter
from dflash_cli.engine.oracle import OracleDrafter, acceptance_for_tau
from dflash_cli.engine.response import first_divergence
from dflash_cli.engine.state import shared_draft_cache
from dflash_cli.engine.target import Target, crop_cache, decoder_layers

HF_CONFIGS = Path(__file__).resolve().parent.parent / "tests" / "data" / "hf-configs"
_QWEN3 = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=128, num_attention_heads=32,
              num_key_value_heads=8, vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000,
              rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False, bos_token_id=151643,
              eos_token_id=151645, num_hidden_layers=36)
PRESETS = {  # name -> (folder under HF_CONFIGS read when present, embedded copy of its fields)
    "cpu-small": (None, dict(_QWEN3, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=32000,
                             max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=None,
                             eos_token_id=None)),
    "qwen3-1.7b": (None, dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                              num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True)),
    "qwen3-4b": ("Qwen__Qwen3-4B", dict(_QWEN3, hidden_size=2560, intermediate_size=9728, tie_word_embeddings=True)),
    "qwen3-8b": ("Qwen__Qwen3-8B", dict(_QWEN3, hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False)),
    # hybrid: 3 Gated DeltaNet layers per attention layer (the fast path rolls their state back exactly)
    "qwen3.5-4b": ("Qwen__Qwen3.5-4B", None),
}
Z_LAB_TAPS, Z_LAB_DEPTH, Z_LAB_MASK_ID = [1, 9, 17, 25, 33], 36, 151669  # z-lab/Qwen3-8B-DFlash-b16
TAUS = (2.0, 4.0, 6.5)
CPU_QUANTS = ("q4", "q8", "q4a8", "q8a8")
PATHS = ("eager", "fast", "compiled")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


# ---------------------------------------------------------------- configs and models

def target_config(args) -> dict:
    if args.target_config:
        cfg = json.loads(Path(args.target_config).read_text())
    else:
        folder, embedded = PRESETS[args.preset]
        path = HF_CONFIGS / folder / "config.json" if folder else None
        if embedded is None and not (path and path.is_file()):
            raise SystemExit(f"preset {args.preset} needs {path}")
        cfg = json.loads(path.read_text()) if path and path.is_file() else dict(embedded)
    cfg = cfg.get("text_config") or cfg
    for key in ("torch_dtype", "dtype", "transformers_version", "auto_map", "quantization_config"):
        cfg.pop(key, None)
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
        cfg.pop("layer_types", None)
        cfg["max_window_layers"] = args.layers
    if args.init == "successor":
        cfg["tie_word_embeddings"] = False  # the planted successor needs an lm_head of its own
    return cfg


def drafter_config(tcfg: dict, block_size: int) -> dict:
    """The z-lab Qwen3-8B-DFlash-b16 shape for this target: 5 layers, 32/8 heads of 128, intermediate 3H."""
    depth, hidden = tcfg["num_hidden_layers"], tcfg["hidden_size"]
    # The reference fallback round(1 + i*(L-4)/(n-1)) for n=5 (docs/format.md section 2), clamped for L < 5.
    taps = Z_LAB_TAPS if depth == Z_LAB_DEPTH else [min(max(round(1 + i * (depth - 4) / 4), 0), depth - 1)
                                                    for i in range(5)]
    vocab = tcfg["vocab_size"]
    return dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=hidden,
                intermediate_size=3 * hidden, num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False, rope_theta=1000000,
                rope_scaling=None, max_position_embeddings=40960, num_target_layers=depth, vocab_size=vocab,
                layer_types=["full_attention"] * 5, block_size=block_size, sliding_window=None,
                use_sliding_window=False,
                dflash_config={"mask_token_id": Z_LAB_MASK_ID if Z_LAB_MASK_ID < vocab else vocab - 1,
                               "target_layer_ids": taps})


@torch.no_grad()
def plant_successor(model, seed: int) -> None:
    """Embeddings that dominate the residual stream and an lm_head mapping token x to perm[x]."""
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    vocab, hidden = emb.shape
    layers = model.config.num_hidden_layers
    gen = torch.Generator(device=emb.device).manual_seed(seed)
    # Random std-0.02 layers add roughly 0.02*sqrt(H) per layer to the residual: stay well above that.
    sigma = max(1.0, 0.05 * math.sqrt(hidden * layers))
    emb.normal_(0.0, sigma, generator=gen)
    perm = torch.randperm(vocab, generator=gen, device=emb.device)
    head.index_copy_(0, perm, emb / (sigma * math.sqrt(hidden)))  # logit(perm[x]) ~ sqrt(H), others ~ N(0,1)


def build_target(cfg: dict, device: torch.device, dtype: torch.dtype, quant: str, init: str, seed: int) -> Target:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(**cfg)
    with torch.device(device):  # built and initialised (normal, std 0.02) directly on the device
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval().requires_grad_(False)
    if init == "successor":
        plant_successor(model, seed)
    model.generation_config.eos_token_id = None  # benchmarks run to the length limit
    model.generation_config.pad_token_id = 0
    if quant in CPU_QUANTS:
        target = Target(model, name="random-target")
        target.weight_quant = quant  # the fast path quantizes the linears (engine/fast.py)
        return target
    if quant != "none":
        from dflash_cli.engine.quant import quantize_linears

        quantize_linears(decoder_layers(model), quant, dtype, device)  # embeddings and lm_head stay 16-bit
    return Target(model, name="random-target")


def build_drafter(cfg: dict, device: torch.device, dtype: torch.dtype, seed: int) -> DFlashDrafter:
    with torch.device("meta"):
        drafter = DFlashDrafter(DrafterConfig.from_dict(cfg))
    drafter = drafter.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0.0, 0.02, generator=gen) if p.dim() > 1 else p.fill_(1.0)
    drafter.init_rotary(device)  # after the cast: RoPE frequencies stay fp32
    return drafter.eval().requires_grad_(False)


def build_assistant(tcfg: dict, device: torch.device, dtype: torch.dtype, seed: int):
    """A small random LM with the target's vocabulary, for transformers' assisted generation."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type="qwen3", vocab_size=tcfg["vocab_size"], hidden_size=256,
                               intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=64, max_position_embeddings=tcfg.get(
                                   "max_position_embeddings", 4096), tie_word_embeddings=True)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval().requires_grad_(False)


def build_hf_dflash_assistant(drafter: DFlashDrafter, device: torch.device, dtype: torch.dtype):
    """transformers' own DFlash drafter class (5.24+: MuseGlimmerAssistantModel) holding our drafter's weights,
    renamed by the engine's mapping to transformers' names (engine/hf_format.py) and loaded strictly, or None
    where this transformers has no DFlash path. Both loops then run the same drafter on the same target."""
    try:
        from transformers import AutoModel, GenerationConfig, MuseGlimmerAssistantConfig
    except ImportError:
        return None
    if not hasattr(GenerationConfig(), "speculation_type"):
        return None
    from dflash_cli.engine.hf_format import to_transformers_config, to_transformers_state_dict

    raw = to_transformers_config(drafter.config)
    raw.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg = MuseGlimmerAssistantConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    with torch.device(device):
        model = AutoModel.from_config(cfg, dtype=dtype)
    model.load_state_dict(to_transformers_state_dict(drafter.state_dict()), strict=True)
    return model.eval().requires_grad_(False)


# ---------------------------------------------------------------- measurements

def timed(fn, device: torch.device, repeats: int, warmup: int = 2, before=None) -> float:
    """Median wall time of fn() over `repeats` calls, synchronised on GPUs; `before()`, untimed, ahead of each."""
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def unit_costs(target: Target, drafter: DFlashDrafter, context: int, blocks: list[int], repeats: int,
               context_rows: int = 4) -> dict:
    """Seconds for one target decode, one verify of B tokens, one draft of B, each on a cache of `context`."""
    dev, vocab = target.device, target.vocab_rows
    ids = torch.randint(0, vocab, (1, context + max(blocks)), device=dev)
    cache = target.shared_cache()  # the one decoding uses: compiled graphs were recorded on its buffers
    _, hidden = target.forward(ids[:, :context], cache, 0, last_logit_only=True, taps=True)  # (1, ctx, F)

    def forward(n: int, taps: bool):
        target.forward(ids[:, context:context + n], cache, context, taps=taps)
        crop_cache(cache, context)

    out = {"context": context, "decode_1": timed(lambda: forward(1, False), dev, repeats)}
    for b in blocks:
        out[f"verify_{b}"] = timed(lambda: forward(b, True), dev, repeats)
    linear = getattr(cache, "linear", None)
    if linear is not None:  # hybrid: settling the linear-attention state after half of a block was accepted
        b = max(blocks)
        target.forward(ids[:, context:context + b], cache, context, taps=True)
        slots = list(linear.slots)

        def rollback():
            linear.settle(context + b // 2)
            linear.slots = list(slots)  # the record again: the next call settles from the same state

        out["rollback"] = timed(rollback, dev, repeats)
        crop_cache(cache, context)
    # Draft cache holds context-P rows; each timed call adds P new context rows plus the block, then rolls back.
    p = context_rows
    rows = target.fast.capacity + drafter.block_size if target.fast is not None else 256
    dcache, anchor = shared_draft_cache(drafter, rows), ids[0, context:context + 1]
    dcache.crop(0)
    drafter.draft(hidden[:, :context - p], anchor, context - p, 2, dcache, target.embed_table, target.logits_head)

    def draft(b: int):  # as a round of b slots drafts: the trained block, its first b - 1 drafts kept
        drafter.draft(hidden[:, context - p:], anchor, context, drafter.block_size, dcache, target.embed_table,
                      target.logits_head, keep=b - 1)
        dcache.crop(context - p)

    # each draft right after a verify of b rows, as generation meets it: the verify streams the target's weights
    # through the caches (a loop of drafts alone keeps the drafter's in them: on a CPU a 1.7B-shaped pair's
    # draft read 27 ms so and 42 inside generation)
    for b in blocks:
        out[f"draft_{b}"] = timed(lambda: draft(b), dev, repeats, before=lambda: forward(b, True))
    out["draft_context_rows"] = p
    return out


def same_prefix(a: list[int], b: list[int]) -> int:
    """Tokens before the first difference (all of them when identical)."""
    d = first_divergence(a, b)
    return min(len(a), len(b)) if d is None else d


def engine_row(name: str, results: list, plain: list | None, block: int) -> dict:
    """Medians over prompts of one engine configuration."""
    stats = [r.stats for r in results]
    steps = [max(s.steps, 1) for s in stats]
    row = dict(config=name, block=block, prompts=len(results),
               tau=median([s.acceptance_length for s in stats]),
               tokens_per_s=median([s.decode_tokens_per_second for s in stats]),
               draft_ms=median([1e3 * s.draft_seconds / n for s, n in zip(stats, steps)]),
               verify_ms=median([1e3 * s.verify_seconds / n for s, n in zip(stats, steps)]),
               other_ms=median([1e3 * (s.decode_seconds - s.draft_seconds - s.verify_seconds) / n
                                for s, n in zip(stats, steps)]),
               step_ms=median([1e3 * s.decode_seconds / n for s, n in zip(stats, steps)]),
               prefill_ms=median([1e3 * s.prefill_seconds for s in stats]),
               peak_bytes=max((s.peak_memory_bytes or 0) for s in stats),
               draft_acceptance=median([s.draft_acceptance for s in stats]),
               histogram=[sum(h) for h in zip(*(s.committed_histogram for s in stats))])
    if plain is not None:  # share of tokens before the first difference from plain greedy decoding
        row["same_as_plain"] = median([same_prefix(r.tokens, p.tokens) / len(p.tokens)
                                       for r, p in zip(results, plain)])
    return row


class KeptCosts:
    """--kept-costs FILE: each adaptive row's round costs and acceptance read from FILE before it runs and written
    back after, through the same `to_dict`/`from_dict` that runtime/round_costs.py keeps them with for `generate`.
    A second run of the same command then measures what a later process of the pair meets, not a first
    contact. Entries are keyed by the row and the settings that change a round's cost."""

    def __init__(self, path: str | None, settings: dict):
        self.path = Path(path) if path else None
        self.settings = json.dumps(settings, sort_keys=True)
        self.data: dict = {}
        if self.path is not None and self.path.exists():
            self.data = json.loads(self.path.read_text())

    def restore(self, name: str, drafter) -> None:
        from dflash_cli.engine.adaptive import RoundCosts, adopt_costs

        kept = self.data.get(f"{self.settings} {name}")
        if self.path is not None and drafter is not None and kept is not None:
            adopt_costs(drafter, RoundCosts.from_dict(kept))

    def keep(self, name: str, drafter) -> None:
        from dflash_cli.engine.adaptive import shared_costs

        if self.path is not None and drafter is not None:
            self.data[f"{self.settings} {name}"] = shared_costs(drafter).to_dict()
            self.path.write_text(json.dumps(self.data))


NO_KEPT_COSTS = KeptCosts(None, {})


def run_engine(name: str, target: Target, make_drafter, prompts: list[list[int]], new_tokens: int,
               adaptive: bool = False, kept: KeptCosts = NO_KEPT_COSTS) -> list:
    """Each prompt with its own `make_drafter(i)`; with `kept` (adaptive rows) each prompt is a process of its own
    that starts from the costs the last one kept."""
    results = []
    for i, prompt in enumerate(prompts):
        drafter = make_drafter(i)
        if adaptive:
            kept.restore(name, drafter)
        # full blocks by default: the oracle rows measure the engine at a chosen tau, not the adaptive controller
        results.append(generate(target, drafter, prompt, max_new_tokens=new_tokens, stop_ids=[], adaptive=adaptive))
        if adaptive:
            kept.keep(name, drafter)
        log(f"  {name} prompt {i + 1}/{len(prompts)}: {results[-1].stats.decode_tokens_per_second:.1f} tok/s, "
            f"tau {results[-1].stats.acceptance_length:.2f}")
    return results


def session_rows(target: Target, drafter: DFlashDrafter, prompts: list[list[int]], new_tokens: int, block: int,
                 args, kept: KeptCosts = NO_KEPT_COSTS) -> list[dict]:
    """--interleave: each prompt runs plain, then with the random drafter, then with each oracle, before the next
    prompt (a VM's speed drifts by more than a paused drafter costs), and every prompt of a row shares its round
    costs and acceptance, as the requests of one loaded pair do (serve, chat, bench's prompts)."""
    from dflash_cli.engine.adaptive import RoundCosts, adopt_costs, shared_costs

    qs = {tau: acceptance_for_tau(tau, block) for tau in args.taus}
    first_oracles: dict[float, OracleDrafter] = {}
    results: dict[str, list] = {name: [] for name in ["plain", "random", *qs]}
    adaptive_kept = kept if args.adaptive else NO_KEPT_COSTS  # a server process started after an earlier one
    adaptive_kept.restore("random drafter", drafter)
    for i, prompt in enumerate(prompts):
        plain = generate(target, None, prompt, max_new_tokens=new_tokens, stop_ids=[])
        results["plain"].append(plain)
        if args.fresh_costs:  # each prompt a first reply: nothing measured before it
            adopt_costs(drafter, RoundCosts())
        results["random"].append(generate(target, drafter, prompt, max_new_tokens=new_tokens, stop_ids=[],
                                          adaptive=args.adaptive))
        for tau, q in qs.items():
            oracle = OracleDrafter(drafter, prompt + plain.tokens, acceptance=q, seed=args.seed + i,
                                   vocab_size=target.vocab_rows)
            if tau not in first_oracles:
                adaptive_kept.restore(f"oracle {tau:g}", oracle)
            if not args.fresh_costs:
                adopt_costs(oracle, shared_costs(first_oracles.setdefault(tau, oracle)))
            results[tau].append(generate(target, oracle, prompt, max_new_tokens=new_tokens, stop_ids=[],
                                         adaptive=args.adaptive))
        log(f"  prompt {i + 1}/{len(prompts)}: " + ", ".join(
            f"{name} {r[-1].stats.decode_tokens_per_second:.1f} tok/s" for name, r in results.items()))
    adaptive_kept.keep("random drafter", drafter)
    for tau, oracle in first_oracles.items():
        adaptive_kept.keep(f"oracle {tau:g}", oracle)
    plains = results["plain"]
    rows = [engine_row("plain", plains, None, 1),
            engine_row("dflash random drafter", results["random"], plains, block)]
    rows += [dict(engine_row(f"dflash oracle tau {tau:g}", results[tau], plains, block), tau_goal=tau,
                  acceptance_q=q) for tau, q in qs.items()]
    for row, name in zip(rows[1:], ["random", *qs]):  # each prompt against its own plain run
        row["paired_speedup"] = median([r.stats.decode_tokens_per_second / p.stats.decode_tokens_per_second
                                        for r, p in zip(results[name], plains)])
    return rows


def hf_rows(target: Target, variants: dict, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    """transformers' generate() for each {row name: extra generate() kwargs}; decode tok/s, prefill excluded.

    The prefill is timed once per prompt as generate(max_new_tokens=1) and subtracted from every variant.
    tau = new tokens per target forward after the prefill (counted with a hook on the target).
    """
    model, dev = target.model, target.device
    calls = [0]
    hook = model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))

    def run(ids, n, **kw):
        calls[0] = 0
        reset_peak_memory(dev)
        synchronize(dev)
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, **kw)
        synchronize(dev)
        return time.perf_counter() - t0, calls[0], peak_memory(dev).peak_bytes

    per: dict[str, list] = {name: [] for name in variants}
    try:
        ids0 = torch.tensor([prompts[0]], device=dev)
        for kw in variants.values():  # warm-up
            run(ids0, min(16, new_tokens), **kw)
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt], device=dev)
            t1 = run(ids, 1)[0]
            for name, kw in variants.items():
                t, n, mem = run(ids, new_tokens, **kw)
                per[name].append(((new_tokens - 1) / max(t - t1, 1e-9), (new_tokens - 1) / max(n - 1, 1), mem))
            log(f"  transformers prompt {i + 1}/{len(prompts)} done")
    finally:
        hook.remove()
    return [dict(config=name, tokens_per_s=median([v[0] for v in values]), tau=median([v[1] for v in values]),
                 peak_bytes=max(v[2] or 0 for v in values)) for name, values in per.items()]


# ---------------------------------------------------------------- output

def fmt(x, spec: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    print(line(headers))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(line(r))
    print()


def print_header(meta: dict) -> None:
    print("# DFlash engine benchmark (random weights)")
    for k in ("torch", "transformers", "bitsandbytes", "device", "dtype", "quant", "target", "drafter",
              "prompts", "prompt_len", "new_tokens", "init"):
        print(f"{k:>13}: {meta[k]}")
    print(flush=True)


def print_units(units: dict) -> None:
    def ms(k):
        return fmt(1e3 * units[k], ".2f")

    d1 = units["decode_1"]
    print(f"## Unit costs (median ms, KV cache of {units['context']} tokens; "
          f"draft adds {units['draft_context_rows']} context rows)")
    blocks = sorted(int(k.split("_")[1]) for k in units if k.startswith("verify_"))
    table = [["decode 1", ms("decode_1"), "1.00", "", ""]]
    for b in blocks:
        v, d = units[f"verify_{b}"], units[f"draft_{b}"]
        table.append([f"B={b}", ms(f"verify_{b}"), fmt(v / d1, ".2f"), ms(f"draft_{b}"), fmt((v + d) / d1, ".2f")])
    print_table(["forward", "verify ms", "verify/dec1", "draft ms", "(ver+draft)/dec1"], table)
    if "rollback" in units:
        print(f"rollback of the linear-attention state (settle {max(blocks) // 2} of {max(blocks)} block tokens): "
              f"{1e3 * units['rollback']:.3f} ms per step, {units['rollback'] / units['decode_1']:.3f} of a decode")
    sys.stdout.flush()


def peak_gib(row: dict, gpu: bool) -> str:
    return fmt(row["peak_bytes"] / 2**30, ".2f") if gpu and row.get("peak_bytes") else "-"


def print_engine(rows: list[dict], block: int, gpu: bool) -> None:
    print("## Engine generation (median over prompts; decode only, prefill excluded)")
    plain = rows[0]["tokens_per_s"]
    table = [[r["config"], fmt(r.get("tau_goal"), ".1f"), fmt(r["tau"], ".2f"), fmt(r["tokens_per_s"], ".1f"),
              fmt(r.get("paired_speedup", r["tokens_per_s"] / plain), ".2f") + "x", fmt(r.get("ideal_speedup"), ".2f"),
              fmt(r["draft_ms"], ".2f"), fmt(r["verify_ms"], ".2f"), fmt(r["other_ms"], ".2f"),
              fmt(r["step_ms"], ".2f"), fmt(r.get("same_as_plain"), ".2f"), peak_gib(r, gpu)] for r in rows]
    print_table(["config", "tau goal", "tau", "tok/s", "speedup", "ideal", "draft ms", "verify ms", "other ms",
                 "step ms", "same", "peak GiB"], table)
    print(f"speedup: vs plain. ideal = tau * t(decode 1) / (t(verify {block}) + t(draft {block})) from the unit costs.")
    print("draft/verify/other/step ms: per verify step; "
          "other = decode time - draft - verify (the loop's own overhead).")
    print("same: share of tokens before the first difference from plain greedy output (1.00 = identical).")
    print(flush=True)


def print_hf(rows: list[dict], engine_plain: float, meta: dict, gpu: bool) -> None:
    print(f"## transformers generate() ({meta['hf_prompts']} prompt(s), {meta['hf_new_tokens']} new tokens; "
          "prefill excluded)")
    hf_plain = rows[0]["tokens_per_s"]
    table = [[r["config"], fmt(r["tau"], ".2f"), fmt(r["tokens_per_s"], ".1f"),
              fmt(r["tokens_per_s"] / hf_plain, ".2f") + "x", fmt(r["tokens_per_s"] / engine_plain, ".2f") + "x",
              peak_gib(r, gpu)] for r in rows]
    print_table(["config", "tau", "tok/s", "vs hf generate", "vs engine plain", "peak GiB"], table)
    print("tau = new tokens per target forward. The assistants have random weights (hf dflash: our random drafter's")
    print("weights, compare with 'dflash random drafter') and almost never agree with the target: these rows")
    print("measure each loop's overhead, not a real speedup.")
    print(flush=True)


# ---------------------------------------------------------------- main

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu-small",
                   help="target shape (default cpu-small: Qwen3, hidden 512, 8 layers, vocab 32k)")
    p.add_argument("--target-config", metavar="PATH",
                   help="a transformers config.json for the target (overrides --preset)")
    p.add_argument("--layers", type=int, help="override the target's depth (quick runs of a big shape)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", default=None,
                   help="float32, bfloat16, float16 (default: bf16 on GPU / bf16 CPUs; fp32 for q4a8/q8a8)")
    p.add_argument("--quant", choices=["none", "nf4", "int8", *CPU_QUANTS], default="none",
                   help="bitsandbytes quantization of the target's decoder layers (nf4, int8), or a CPU format "
                        "of the fast path (q4, q8, q4a8, q8a8) (default none)")
    p.add_argument("--prompts", type=int, help="random prompts, results are medians (default 3; 2 quantized on GPU)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt length in tokens (default 128)")
    p.add_argument("--new-tokens", type=int,
                   help="tokens to generate per prompt (default 128 on CPU and for quantized GPU targets, 256 on GPU)")
    p.add_argument("--block-size", type=int, default=16, help="drafter block size B (default 16)")
    p.add_argument("--taus", type=float, nargs="*", default=list(TAUS),
                   help="oracle target tau values (default 2 4 6.5)")
    p.add_argument("--repeats", type=int, help="timed calls per unit cost (default 10 CPU, 30 GPU)")
    p.add_argument("--init", choices=["successor", "random"], default="successor",
                   help="successor (default): plant a successor permutation so greedy output is stable; "
                        "random: plain std-0.02 weights (bf16 oracle runs then drift off their reference)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' generate() baselines")
    p.add_argument("--hf-prompts", type=int, default=1, help="prompts for the transformers baselines (default 1)")
    p.add_argument("--hf-new-tokens", type=int, default=128,
                   help="new tokens for the transformers baselines, at most --new-tokens (default 128)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--adaptive", action="store_true",
                   help="speculative rows choose their block sizes as generate does (default: full blocks)")
    p.add_argument("--interleave", action="store_true",
                   help="run the rows prompt by prompt (plain, random drafter, oracles, then the next prompt), "
                        "each row's prompts sharing round costs as one session's requests do; speedup is then "
                        "each prompt against its own plain run (median)")
    p.add_argument("--kept-costs", metavar="FILE",
                   help="adaptive rows start from the round costs FILE kept (a later process of the pair) and "
                        "leave theirs there: run the same command twice to measure the second")
    p.add_argument("--fresh-costs", action="store_true",
                   help="with --interleave: every prompt's rows start from nothing measured (each a process's "
                        "first reply) instead of sharing costs across prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke run: 1 prompt of 32 tokens, 24 new tokens, 3 repeats")
    p.add_argument("--json", metavar="FILE", help="also write all numbers to FILE")
    p.add_argument("--units-only", action="store_true",
                   help="only the unit costs (decode, verify, draft, rollback): minutes less on big CPU shapes")
    p.add_argument("--paths", nargs="+", choices=list(PATHS), default=None,
                   help="target forwards to measure side by side: eager (transformers' forward, dynamic cache), "
                        "fast (static cache, eager), compiled (static cache, torch.compile) "
                        "(default: eager fast on CPU, eager fast compiled on GPU)")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.prompt_len, args.new_tokens, args.repeats = 1, 32, 24, 3
    if args.target_config and not Path(args.target_config).is_file():
        p.error(f"--target-config {args.target_config}: no such file")
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be >= 1")
    if args.quant in CPU_QUANTS:
        args.paths, args.no_hf = ["fast"], True  # the fast path frees the dense weights it quantized
    elif args.quant != "none" and importlib.util.find_spec("bitsandbytes") is None:
        p.error(f"--quant {args.quant} needs bitsandbytes, which is not installed (pip install bitsandbytes)")
    return args


def versions() -> dict:
    import transformers

    bnb = "not installed"
    if importlib.util.find_spec("bitsandbytes") is not None:
        from importlib.metadata import version

        bnb = version("bitsandbytes")
    return {"torch": torch.__version__, "transformers": transformers.__version__, "bitsandbytes": bnb}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({device})"
    model = platform.processor() or "cpu"
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {torch.get_num_threads()} threads"


def compile_path(target: Target, drafter: DFlashDrafter, step, block: int, out: dict) -> None:
    """Compiles (and on CUDA records) what the engine's loop runs, as `session.enable_fast_path` does, plus
    the untapped 1-token decode that the unit costs time; notes the seconds, the outcome and the graphs."""
    from dflash_cli.engine.draft_graph import StaticDraft
    from dflash_cli.engine.kernels import cuda_graphs

    device = target.device
    log("[compiled] compiling the verify forwards, the drafter and the 1-token decode ...")
    t0 = time.perf_counter()
    target.fast.precompile(taps=True, max_block=block)
    target.fast.precompile(taps=False, max_block=1)
    drafter.static_draft = StaticDraft(drafter, compile_step=step, on_fallback=lambda m: log(f"  {m}"))
    drafter.static_draft.precompile(shared_draft_cache(drafter, target.fast.capacity + block),
                                        target.hidden_size, target.device)
    synchronize(device)
    out["compile_seconds"] = time.perf_counter() - t0
    out["compiled"] = target.fast_compiled
    out["compile_failure"] = target.fast.fallback_reason
    out["drafter_compiled"] = drafter.static_draft.compiled
    out["cuda_graphs"] = cuda_graphs(device)
    log(f"compiled in {out['compile_seconds']:.0f}s" + ("" if target.fast_compiled else " (FAILED: eager)")
        + ("" if out["drafter_compiled"] else "; drafter eager")
        + (f"; CUDA graphs: {out['cuda_graphs']}" if out["cuda_graphs"] else ""))


def measure_path(path: str, target: Target, drafter: DFlashDrafter, prompts: list[list[int]], new_tokens: int,
                 block: int, repeats: int, args, gpu: bool) -> dict:
    """Unit costs and the engine table for one target forward: eager, fast or compiled."""
    device = target.device
    target.disable_fast_path()
    out: dict = {"compile_seconds": None}
    if path == "eager" and target.hybrid:
        log("eager: transformers' cache cannot roll a hybrid target's linear-attention state back; skipped")
        return out
    if path != "eager":
        context = args.prompt_len + new_tokens + 2 * block
        step = compiler_for(device) if path == "compiled" else None
        reason = target.enable_fast_path(context, pad_to=block, compile_step=step,
                                         on_fallback=lambda m: log(f"  {m}"))
        if reason is not None:
            log(f"{path}: this target cannot take the fast path ({reason}); skipped")
            return out
        drafter.static_draft = None
        if target.weight_quant in ("q4a8", "q8a8") and not getattr(drafter, "native_layers", None):
            from dflash_cli.engine.cpu.c_layers import fuse_drafter
            from dflash_cli.engine.cpu.int8act import quantize_drafter

            quantize_drafter(drafter)  # as the CLI runs it: the same few rows as the target's, on the same kernels
            fuse_drafter(drafter)
            drafter.greedy_head_for(target.logits_head)  # its shortlist's 4-bit head, made at load as the CLI does
        if target.weight_quant:
            out["memory"] = memory_report(target, drafter)
            print_memory(out["memory"])
        if path == "compiled":
            compile_path(target, drafter, step, block, out)
        out["attention"] = target.fast.attention_kernel
        log(f"[{path}] attention: {out['attention']}")
    print(f"\n## {path} path")
    if args.units_only:
        units = out["unit_costs"] = unit_costs(target, drafter, args.prompt_len + new_tokens // 2,
                                               sorted({4, 8, 16, block} & set(range(2, block + 1)) | {block}),
                                               repeats)
        print_units(units)
        return out
    # Full-length warm-up of both loops: on the GPU the first pass through each new cache length is
    # about twice as slow (per-shape setup), and would otherwise land in the first measured prompt.
    log(f"[{path}] warm-up")
    generate(target, None, prompts[0], max_new_tokens=new_tokens, stop_ids=[])
    generate(target, drafter, prompts[0], max_new_tokens=new_tokens, stop_ids=[])

    log(f"[{path}] unit costs")
    blocks = sorted({4, 8, 16, block} & set(range(2, block + 1)) | {block})
    units = out["unit_costs"] = unit_costs(target, drafter, args.prompt_len + new_tokens // 2, blocks, repeats)
    print_units(units)

    kept = KeptCosts(args.kept_costs, dict(path=path, quant=args.quant, preset=args.preset, layers=args.layers,
                                           prompt_len=args.prompt_len, block=block, threads=torch.get_num_threads()))
    if args.interleave:
        rows = out["rows"] = session_rows(target, drafter, prompts, new_tokens, block, args, kept)
    else:
        log(f"[{path}] plain decoding")
        plain = run_engine("plain", target, lambda i: None, prompts, new_tokens)
        rows = out["rows"] = [engine_row("plain", plain, None, 1)]
        log(f"[{path}] speculative, random drafter")
        spec = run_engine("random drafter", target, lambda i: drafter, prompts, new_tokens, args.adaptive, kept)
        rows.append(engine_row("dflash random drafter", spec, plain, block))
        refs = [p + r.tokens for p, r in zip(prompts, plain)]
        for tau in args.taus:
            q = acceptance_for_tau(tau, block)
            log(f"[{path}] speculative, oracle tau {tau} (q={q:.3f})")
            res = run_engine(f"oracle {tau}", target,
                             lambda i: OracleDrafter(drafter, refs[i], acceptance=q, seed=args.seed + i,
                                                     vocab_size=target.vocab_rows), prompts, new_tokens, args.adaptive,
                             kept)
            rows.append(dict(engine_row(f"dflash oracle tau {tau:g}", res, plain, block), tau_goal=tau, acceptance_q=q))
    for r in rows[1:]:
        r["ideal_speedup"] = r["tau"] * units["decode_1"] / (units[f"verify_{block}"] + units[f"draft_{block}"])
    print_engine(rows, block, gpu)
    if path == "compiled":
        from dflash_cli.engine.kernels import cuda_graphs

        out["cuda_graphs_after"] = cuda_graphs(device)  # graphs recorded while decoding: new shapes, new lengths
        if out["cuda_graphs_after"]:
            log(f"[compiled] CUDA graphs after decoding: {out['cuda_graphs_after']}")
    return out


def resident_bytes() -> int:
    """The process's resident set now (Linux), not its peak."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def tensor_sizes(module: torch.nn.Module) -> dict[int, int]:
    """Bytes of the parameters and buffers of `module` by data pointer (tensors shared between them counted
    once)."""
    seen: dict[int, int] = {}
    for t in [*module.parameters(), *module.buffers()]:
        seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.numel() * t.element_size())
    for m in module.modules():  # the quantized layers keep their codes as plain tensor attributes
        for name, value in vars(m).items():  # (`source`: a dense weight the model holds, counted there)
            if isinstance(value, torch.Tensor) and value.numel() and name != "source":
                seen[value.data_ptr()] = max(seen.get(value.data_ptr(), 0), value.numel() * value.element_size())
    return seen


def tensor_bytes(module: torch.nn.Module) -> int:
    return sum(tensor_sizes(module).values())


def memory_report(target: Target, drafter: DFlashDrafter) -> dict:
    """What the quantized target holds against the process's resident memory, after the fast path is built."""
    import gc

    gc.collect()
    fast = target.fast
    held = dict(target_held_bytes(target), drafter=tensor_bytes(drafter))
    return dict(held, freed=fast.freed_bytes, resident=resident_bytes(), held_total=sum(held.values()))


def target_held_bytes(target: Target) -> dict[str, int]:
    """Bytes of a fast-path target's codes and scales, the dense tensors its model still holds, and its cache."""
    fast = target.fast
    cache = fast.shared_cache()
    codes = {**tensor_sizes(fast.projections), **tensor_sizes(fast.lm_head)}
    # the model holds the head's codes too where they are its embeddings (a tied head under q4a8/q8a8)
    dense = {ptr: size for ptr, size in tensor_sizes(target.model).items() if ptr not in codes}
    return dict(codes=sum(codes.values()), dense=sum(dense.values()),
                caches=sum(t.numel() * t.element_size() for t in [*cache.keys, *cache.values]))


def print_memory(m: dict) -> None:
    gib = 2**30
    print(f"memory: codes+scales {m['codes'] / gib:.2f} GiB, dense tensors left {m['dense'] / gib:.2f} GiB "
          f"(norms; embeddings unless a tied head's codes serve), drafter {m['drafter'] / gib:.2f} GiB, caches "
          f"{m['caches'] / gib:.2f} GiB: {m['held_total'] / gib:.2f} GiB held; process resident "
          f"{m['resident'] / gib:.2f} GiB ({m['resident'] / m['held_total']:.2f}x what is held, "
          f"{m['resident'] / (m['codes'] + m['caches']):.2f}x the codes and caches, "
          f"{m['resident'] / (m['codes'] + m['caches'] + m['drafter']):.2f}x with the drafter's); freed "
          f"{m['freed'] / gib:.2f} GiB of dense weights once quantized")


def print_paths(paths: dict, block: int) -> None:
    """One line per path: unit costs, plain and best-oracle tok/s, each against the eager path."""
    measured = {name: res for name, res in paths.items() if "rows" in res}
    if not measured:
        return
    base = measured.get("eager") or next(iter(measured.values()))
    base_plain = base["rows"][0]["tokens_per_s"]
    table = []
    for name, res in paths.items():
        if "rows" not in res:
            continue
        u, rows = res["unit_costs"], res["rows"]
        best = max(rows[1:], key=lambda r: r["tokens_per_s"])
        table.append([name, fmt(1e3 * u["decode_1"], ".2f"), fmt(1e3 * u[f"verify_{block}"], ".2f"),
                      fmt(1e3 * u[f"draft_{block}"], ".2f"),
                      fmt((u[f"verify_{block}"] + u[f"draft_{block}"]) / u["decode_1"], ".2f"),
                      fmt(rows[0]["tokens_per_s"], ".1f"), fmt(rows[0]["tokens_per_s"] / base_plain, ".2f") + "x",
                      best["config"].replace("dflash ", ""), fmt(best["tokens_per_s"], ".1f"),
                      fmt(best["tokens_per_s"] / base_plain, ".2f") + "x",
                      fmt(res.get("compile_seconds"), ".0f") if res.get("compile_seconds") is not None else "-"])
    print("\n## paths side by side (ratios against the eager path's plain decoding, same run)")
    print_table(["path", "decode 1 ms", f"verify {block} ms", f"draft {block} ms", "(ver+draft)/dec1",
                 "plain tok/s", "plain vs eager", "best dflash", "tok/s", "vs eager plain", "compile s"], table)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    # q4a8/q8a8 compute in fp32 around their 8-bit matmuls (the CLI refuses them with another dtype)
    integer_formats = args.quant in ("q4a8", "q8a8") and args.dtype is None
    dtype = torch.float32 if integer_formats else pick_dtype(args.dtype, device)
    gpu = device.type == "cuda"
    # Quantized GPU runs get less work: quantizing takes about a minute and their verify forwards are slower.
    new_tokens = args.new_tokens or (256 if gpu and args.quant == "none" else 128)
    n_prompts = args.prompts or (2 if gpu and args.quant != "none" else 3)
    repeats = args.repeats or (30 if gpu else 10)
    tcfg = target_config(args)
    dcfg = drafter_config(tcfg, args.block_size)

    t0 = time.perf_counter()
    log(f"building target ({tcfg['num_hidden_layers']} layers, hidden {tcfg['hidden_size']}) on {device}, {dtype}")
    target = build_target(tcfg, device, dtype, args.quant, args.init, args.seed)
    drafter = build_drafter(dcfg, device, dtype, args.seed + 1)
    attach_drafter(target, drafter)
    synchronize(device)
    n_target = sum(p.numel() for p in target.model.parameters())
    n_drafter = sum(p.numel() for p in drafter.parameters())
    log(f"built in {time.perf_counter() - t0:.1f}s: target {n_target / 1e6:.0f}M, "
        f"drafter {n_drafter / 1e6:.0f}M params; resident {resident_bytes() / 2**30:.2f} GiB")

    if not gpu and hasattr(os, "getloadavg") and os.getloadavg()[0] > 0.5 * (os.cpu_count() or 1):
        log(f"warning: load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores: other processes compete "
            "for the CPU and timings may swing widely (--threads 1 is steadier)")
    meta = dict(versions(), device=device_name(device), dtype=str(dtype).replace("torch.", ""), quant=args.quant,
                target=f"{args.target_config or args.preset}: {tcfg['num_hidden_layers']} layers, hidden "
                       f"{tcfg['hidden_size']}, vocab {tcfg['vocab_size']}, {n_target / 1e6:.0f}M params",
                drafter=f"5 layers, taps {dcfg['dflash_config']['target_layer_ids']}, B={args.block_size}, "
                        f"{n_drafter / 1e6:.0f}M params",
                prompts=n_prompts, hf_prompts=min(args.hf_prompts, n_prompts), prompt_len=args.prompt_len,
                new_tokens=new_tokens, init=args.init,
                build_seconds=time.perf_counter() - t0)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, tcfg["vocab_size"], (args.prompt_len,), generator=gen).tolist()
               for _ in range(n_prompts)]
    block = args.block_size

    hf_new_tokens = min(new_tokens, args.hf_new_tokens)
    meta.update(hf_new_tokens=hf_new_tokens)
    results = dict(meta=meta, target_config=tcfg, drafter_config=dcfg)

    def save() -> None:  # after every section, so a run cut short still leaves its numbers
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2) + "\n")

    print_header(meta)
    paths = args.paths or (["eager", "fast", "compiled"] if gpu else ["eager", "fast"])
    results["paths"] = {}
    for path in paths:
        results["paths"][path] = measure_path(path, target, drafter, prompts, new_tokens, block, repeats, args, gpu)
        save()
    rows = results["paths"][paths[0]].get("rows") or [{"tokens_per_s": float("nan")}]
    if len(paths) > 1:
        print_paths(results["paths"], block)
    target.disable_fast_path()

    if not args.no_hf and not args.units_only:
        log("transformers generate() baselines")
        variants = {"hf generate": {},
                    "hf assisted (random LM)": dict(
                        assistant_model=build_assistant(tcfg, device, dtype, args.seed + 2))}
        hf_dflash = build_hf_dflash_assistant(drafter, device, dtype)
        if hf_dflash is not None:
            variants["hf dflash (same drafter)"] = dict(assistant_model=hf_dflash, speculation_type="dflash")
        else:
            log("  this transformers has no generate(speculation_type='dflash'): skipping that row")
        try:
            hf = results["hf_rows"] = hf_rows(target, variants, prompts[:args.hf_prompts], hf_new_tokens)
            print_hf(hf, rows[0]["tokens_per_s"], meta, gpu)
        except Exception as e:  # an outside baseline must not sink the run
            log(f"transformers baseline failed: {type(e).__name__}: {e}")
        del variants, hf_dflash

    if not gpu:
        meta["peak_rss_gib"] = round(peak_memory(device).peak_bytes / 2**30, 2)
        print(f"peak memory: process RSS {meta['peak_rss_gib']} GiB for the whole run "
              "(per-configuration peaks: GPU only)")
    meta["total_seconds"] = time.perf_counter() - t0
    save()
    log(f"done in {meta['total_seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
