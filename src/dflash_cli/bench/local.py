"""Benchmark: plain decoding vs DFlash on prompt sets, interleaved per prompt, with the paper's metrics.

No printing here: `run_bench` returns a BenchReport (pure data, `to_dict`/`to_json`), `format_table` turns
it into aligned text lines, and the command in ui/bench_cmd.py does the output. Metrics follow
docs/format.md section 6: tau (acceptance length, bonus token included) macro-averaged per response
as the paper does and pooled over the set; draft acceptance (accepted / drafted, pooled); per-position
acceptance (pooled counts); decode-only tokens per second of both modes (prefill excluded, from the
engine's own statistics); speedup = plain time per token / DFlash time per token, pooled over the set.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from dflash_cli.engine.errors import DFlashError
from dflash_cli.engine.response import first_divergence
from dflash_cli.prompts.reader import Prompt, PromptSetError
from dflash_cli.tables import columns

if TYPE_CHECKING:  # the engine imports torch: only for annotations here
    from dflash_cli.engine.drafter import Drafter
    from dflash_cli.engine.target import Target

HF_BASELINE_OFF = (
    "transformers' assisted generation (generate(assistant_model=...)) needs a standalone causal LM as the "
    "assistant, drafting one token per forward from token ids alone; a DFlash drafter drafts a whole block "
    "in one pass from the target's hidden states, so the pair cannot be expressed in that format")


# -- the report -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunRecord:
    """One generation of one prompt in one mode."""

    mode: str  # "plain", "dflash" or "hf-assisted"
    sequence: int  # order of this generation in the whole run (warm-up excluded), from 0
    generated_tokens: int
    decode_tokens: int  # tokens committed by verify steps: the first comes from the prefill
    decode_seconds: float
    prefill_seconds: float
    steps: int
    drafted: int
    accepted: int
    acceptance_length: float
    decode_tokens_per_second: float
    finish_reason: str | None
    committed_histogram: list[int] = field(default_factory=list)  # [k] = steps that committed k+1 tokens
    position_drafted: list[int] = field(default_factory=list)  # [k] = steps that drafted position k+1
    position_accepted: list[int] = field(default_factory=list)  # [k] = steps that accepted position k+1


@dataclass(frozen=True)
class PromptRecord:
    set: str
    id: str
    prompt_tokens: int
    plain: RunRecord
    dflash: RunRecord
    identical: bool
    first_divergence: int | None  # first token index where the outputs differ (None when identical)
    hf: RunRecord | None = None
    hf_identical: bool | None = None  # the hf-assisted output equals the plain one (None: column off)


@dataclass(frozen=True)
class SetSummary:
    name: str
    prompts: int
    generated_tokens_plain: int
    generated_tokens_dflash: int
    tau_macro: float  # mean over responses of each response's tau (the paper's figure)
    tau_pooled: float  # all decode tokens / all verify steps
    draft_acceptance: float  # pooled accepted / drafted
    accepted: int
    drafted: int
    per_position_acceptance: list[float]
    position_accepted: list[int]
    position_drafted: list[int]
    committed_histogram: list[int]  # [k] = verify steps that committed k+1 tokens (pooled)
    plain_tokens_per_second: float  # pooled decode tokens / decode seconds
    dflash_tokens_per_second: float
    speedup: float | None  # plain seconds per token / DFlash seconds per token (pooled)
    identical: int
    total: int
    divergences: list[dict[str, Any]]  # [{"id": ..., "first_divergence": ...}] for non-identical outputs
    hf_tokens_per_second: float | None = None  # end to end (prefill included), when the hf column ran


@dataclass
class BenchReport:
    settings: dict[str, Any]
    sets: dict[str, SetSummary]
    overall: SetSummary
    records: list[PromptRecord]
    hf_baseline: dict[str, Any]  # {"enabled": bool, "reason": str | None}
    meta: dict[str, Any] = field(default_factory=dict)  # filled by callers: model, drafter, device, ...

    def to_dict(self) -> dict[str, Any]:
        return {"settings": dict(self.settings), "meta": dict(self.meta), "hf_baseline": dict(self.hf_baseline),
                "sets": {k: asdict(v) for k, v in self.sets.items()}, "overall": asdict(self.overall),
                "records": [asdict(r) for r in self.records]}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)


# -- the measurement loop -------------------------------------------------------------------------------


def _record(mode: str, sequence: int, stats: Any) -> RunRecord:
    return RunRecord(mode, sequence, stats.generated_tokens, stats.decode_tokens, stats.decode_seconds,
                     stats.prefill_seconds, stats.steps, stats.drafted, stats.accepted, stats.acceptance_length,
                     stats.decode_tokens_per_second, stats.finish_reason, list(stats.committed_histogram),
                     list(stats.position_drafted), list(stats.position_accepted))


def _hf_assistant(candidate: Any) -> Any | None:
    """`candidate` as a transformers assistant_model, or None when it cannot be one (any DFlash drafter)."""
    from transformers import PreTrainedModel

    if isinstance(candidate, PreTrainedModel) and hasattr(candidate, "generate"):
        return candidate
    return None


def _hf_generate(target: Any, assistant: Any, prompt: list[int], max_new_tokens: int, stop_ids: list[int],
                 sequence: int) -> tuple[list[int], RunRecord]:
    """transformers' own assisted generation, greedy; timed end to end (it reports no prefill split)."""
    import torch

    from dflash_cli.engine.device import synchronize

    ids = torch.tensor([prompt], device=target.device)
    synchronize(target.device)
    started = time.perf_counter()
    with torch.inference_mode():
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=assistant,
                                    do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=stop_ids or None)
    synchronize(target.device)
    seconds = time.perf_counter() - started
    tokens = out[0, len(prompt):].tolist()
    cut = next((i for i, t in enumerate(tokens) if t in stop_ids), None)
    if cut is not None:
        tokens = tokens[: cut + 1]
    finish = "stop" if cut is not None else "length"
    return tokens, RunRecord("hf-assisted", sequence, len(tokens), len(tokens), seconds, 0.0, 0, 0, 0, 0.0,
                             len(tokens) / seconds if seconds > 0 else 0.0, finish)


def _work(prompt_sets: Mapping[str, Sequence[str | Prompt]], per_set: int | None,
          encode: Callable[[Prompt], list[int]]) -> list[tuple[str, Prompt, list[int]]]:
    """(set, prompt, prompt token ids) of every prompt to run, in order; none at all is an error."""
    work = []
    for name, items in prompt_sets.items():
        chosen = list(items)[:per_set] if per_set is not None else list(items)
        for i, item in enumerate(chosen, 1):
            p = item if isinstance(item, Prompt) else Prompt(f"{name}-{i}", str(item))
            work.append((name, p, encode(p)))
    if not work:
        raise PromptSetError("no prompts to run")
    return work


LONG_CONTEXT_HEADER = "Here are my notes. Read them, then answer the request that follows.\n\nNotes:\n"


def long_context_ids(tokenizer: Any, text: str, context: int, **encode_args: Any) -> list[int]:
    """`text` behind notes that fill the prompt to about `context` tokens (`bench --context`): the built-in
    prompt sets' texts, cycled, cut at a token boundary. The request comes last, as a long document's
    question does."""
    from dflash_cli.engine.text import encode_prompt
    from dflash_cli.prompts.reader import DEFAULT_SETS, load_prompt_set

    def ids_with(notes: str) -> list[int]:
        return encode_prompt(tokenizer, f"{LONG_CONTEXT_HEADER}{notes}\n\nRequest: {text}", **encode_args)

    room = context - len(ids_with(""))
    if room <= 0:
        return ids_with("")
    pool = "\n".join(p.prompt for name in DEFAULT_SETS for p in load_prompt_set(name))
    pool_ids = tokenizer.encode(pool, add_special_tokens=False)
    notes_ids = (pool_ids * (room // max(len(pool_ids), 1) + 1))[:room]
    return ids_with(tokenizer.decode(notes_ids))


def _mode_kwargs(p: Prompt, tokenizer: Any, extra: dict[str, Any]) -> dict[str, Any]:
    """`extra` plus, for a structured prompt, its format (the grammar reads tokens through the tokenizer)."""
    from dflash_cli.engine.output_format import parse_format_setting

    if p.output is None:
        return extra
    return {**extra, "output_format": parse_format_setting(*p.output), "tokenizer": tokenizer}


def _encode(tokenizer: Any, p: Prompt, enable_thinking: bool | None, context: int | None) -> list[int]:
    """A bench prompt's ids: thinking off for a structured reply, behind notes with `context`."""
    from dflash_cli.engine.text import encode_prompt

    thinking = False if p.output is not None else enable_thinking
    if context:
        return long_context_ids(tokenizer, p.prompt, context, enable_thinking=thinking)
    return encode_prompt(tokenizer, p.prompt, enable_thinking=thinking)


def _hf_baseline(hf_baseline: bool | Any, drafter: Any) -> tuple[Any, dict[str, Any]]:
    """(the assistant model transformers' assisted generate runs with, or None; what the report says)."""
    requested = hf_baseline is not False and hf_baseline is not None
    assistant = _hf_assistant(drafter if hf_baseline is True else hf_baseline) if requested else None
    if assistant is not None:
        return assistant, {"enabled": True, "reason": None, "assistant": type(assistant).__name__,
                           "timing": "end to end, prefill included (generate reports no split)"}
    if requested:
        return None, {"enabled": False, "reason": "requested, but " + HF_BASELINE_OFF}
    return None, {"enabled": False, "reason": "off by default: " + HF_BASELINE_OFF}


def run_bench(target: Target, drafter: Drafter | None, tokenizer: Any,
              prompt_sets: Mapping[str, Sequence[str | Prompt]], *,
              max_new_tokens: int, block_size: int | None = None, warmup: int = 2, per_set: int | None = None,
              on_progress: Callable[[int, int, str], None] | None = None, hf_baseline: bool | Any = False,
              enable_thinking: bool | None = None, adaptive: bool = False,
              on_generation: Callable[[str, str, str], None] | None = None,
              context: int | None = None) -> BenchReport:
    """Runs every prompt of every set with plain decoding then DFlash decoding, interleaved per prompt.

    Greedy (temperature 0), chat template applied (when the tokenizer has one), the target's own stop
    ids, a new conversation (on the model's one cache) per generation. `warmup` prompts are first run in
    both modes and not measured.

    Args:
        prompt_sets: set name -> prompts (strings or Prompt objects), in the order to run them.
        per_set: use only the first N prompts of each set.
        on_progress: called as (done, total, label) before the first prompt and after each one.
        hf_baseline: also time transformers' assisted generate (target.model.generate(assistant_model=...)).
            True asks for the drafter as the assistant, which a DFlash drafter can never be (the report
            says why: HF_BASELINE_OFF); a transformers causal LM sharing the target's tokenizer (a small
            AR draft model) is used as the assistant instead, for a DFlash vs classic-speculation column.
        on_generation: called as (set, prompt id, mode) before each measured generation (for tests/logs).
        adaptive: the dflash runs choose their block size each round as `generate` does (a fresh controller
            per prompt); off: every round drafts a full block, so tau measures the drafter itself.
        context: each prompt behind notes that fill it to about this many tokens (long_context_ids).
    """
    from dflash_cli.engine.generate import default_stop_ids, generate, resolve_block_size

    if drafter is None:
        raise DFlashError("a benchmark needs a drafter: it compares plain decoding with DFlash")
    block = resolve_block_size(drafter, block_size)
    stops = default_stop_ids(target, tokenizer)
    work = _work(prompt_sets, per_set, lambda p: _encode(tokenizer, p, enable_thinking, context))
    kwargs = dict(tokenizer=None, max_new_tokens=max_new_tokens, temperature=0.0, stop_ids=stops)
    assistant, hf_info = _hf_baseline(hf_baseline, drafter)

    progress = on_progress or (lambda done, total, label: None)
    progress(0, len(work), "warming up")
    for _, _, prompt in work[:max(warmup, 0)]:  # same prompts and lengths as measured
        generate(target, None, prompt, **kwargs)
        generate(target, drafter, prompt, block_size=block, adaptive=adaptive, **kwargs)

    records: list[PromptRecord] = []
    sequence = 0
    for done, (name, p, prompt) in enumerate(work, 1):
        runs = {}
        for mode, d in (("plain", None), ("dflash", drafter)):
            if on_generation is not None:
                on_generation(name, p.id, mode)
            extra = _mode_kwargs(p, tokenizer, dict(block_size=block, adaptive=adaptive) if d is not None else {})
            result = generate(target, d, prompt, **{**kwargs, **extra})
            runs[mode] = (result.tokens, result.stats, sequence)
            sequence += 1
        hf_record = hf_tokens = None
        if assistant is not None:
            if on_generation is not None:
                on_generation(name, p.id, "hf-assisted")
            hf_tokens, hf_record = _hf_generate(target, assistant, prompt, max_new_tokens, stops, sequence)
            sequence += 1
        plain_tokens, plain_stats, plain_seq = runs["plain"]
        dflash_tokens, dflash_stats, dflash_seq = runs["dflash"]
        diverge = first_divergence(plain_tokens, dflash_tokens)
        records.append(PromptRecord(
            name, p.id, len(prompt), _record("plain", plain_seq, plain_stats),
            _record("dflash", dflash_seq, dflash_stats), diverge is None, diverge, hf_record,
            None if hf_tokens is None else hf_tokens == plain_tokens))
        progress(done, len(work), f"{name} {p.id}")

    by_set: dict[str, list[PromptRecord]] = {}
    for r in records:
        by_set.setdefault(r.set, []).append(r)
    sets = {name: summarize(name, rs, block) for name, rs in by_set.items()}  # in the order they ran
    settings = {"max_new_tokens": max_new_tokens, "block_size": block, "trained_block_size": drafter.block_size,
                "adaptive": adaptive, **_run_settings(drafter, tokenizer, assistant is not None),
                "enable_thinking": enable_thinking, "warmup": warmup, "per_set": per_set, "context": context,
                "stop_ids": stops}
    return BenchReport(settings, sets, summarize("all", records, block), records, hf_info)


def _run_settings(drafter: Drafter, tokenizer: Any, hf_assisted: bool) -> dict[str, Any]:
    """What a bench run's settings say of the sampling, the template, the drafter's window and the order."""
    from dflash_cli.engine.text import chat_template_of

    return {"temperature": 0.0, "chat_template": bool(chat_template_of(tokenizer)),
            "draft_window": getattr(drafter, "context_window", None),
            "interleaved": "per prompt: plain, then dflash" + (", then hf-assisted" if hf_assisted else "")}


def summarize(name: str, records: Sequence[PromptRecord], block_size: int) -> SetSummary:
    """Pooled and macro-averaged figures over `records` (the "all" row pools every set)."""
    plain = [r.plain for r in records]
    spec = [r.dflash for r in records]
    steps = sum(r.steps for r in spec)
    decode = sum(r.decode_tokens for r in spec)
    taus = [r.acceptance_length for r in spec if r.steps]
    drafted, accepted = sum(r.drafted for r in spec), sum(r.accepted for r in spec)
    pos_acc, pos_dr, hist = _pooled_positions(records, block_size)

    def rate(runs: list[RunRecord]) -> float:
        seconds = sum(r.decode_seconds for r in runs)
        return sum(r.decode_tokens for r in runs) / seconds if seconds > 0 else 0.0

    plain_rate, spec_rate = rate(plain), rate(spec)
    hf = [r.hf for r in records if r.hf is not None]
    hf_seconds = sum(r.decode_seconds for r in hf)
    return SetSummary(
        name=name, prompts=len(records),
        generated_tokens_plain=sum(r.generated_tokens for r in plain),
        generated_tokens_dflash=sum(r.generated_tokens for r in spec),
        tau_macro=sum(taus) / len(taus) if taus else 0.0, tau_pooled=decode / steps if steps else 0.0,
        draft_acceptance=accepted / drafted if drafted else 0.0, accepted=accepted, drafted=drafted,
        per_position_acceptance=[a / d if d else 0.0 for a, d in zip(pos_acc, pos_dr)],
        position_accepted=pos_acc, position_drafted=pos_dr, committed_histogram=hist,
        plain_tokens_per_second=plain_rate, dflash_tokens_per_second=spec_rate,
        # plain s/token over DFlash s/token == DFlash tokens/s over plain tokens/s
        speedup=spec_rate / plain_rate if plain_rate > 0 and spec_rate > 0 else None,
        identical=sum(r.identical for r in records), total=len(records),
        divergences=[{"set": r.set, "id": r.id, "first_divergence": r.first_divergence}
                     for r in records if not r.identical],
        hf_tokens_per_second=(sum(r.generated_tokens for r in hf) / hf_seconds if hf and hf_seconds > 0 else None))


def _pooled_positions(records: Sequence[PromptRecord], block_size: int) -> tuple[list[int], list[int], list[int]]:
    """Per-position accepted and drafted counts, and the committed histogram, summed over the dflash runs."""
    pos_acc = [0] * max(block_size - 1, 0)
    pos_dr = [0] * max(block_size - 1, 0)
    hist = [0] * block_size
    for r in records:
        for total, counts in ((pos_acc, r.dflash.position_accepted), (pos_dr, r.dflash.position_drafted),
                              (hist, r.dflash.committed_histogram)):
            for k, v in enumerate(counts[: len(total)]):
                total[k] += v
    return pos_acc, pos_dr, hist


# -- text -----------------------------------------------------------------------------------------------


def format_table(report: BenchReport) -> list[str]:
    """Aligned text lines: one row per set plus "all", per-position acceptance, divergences, settings."""
    header = ["set", "prompts", "tau", "tau pooled", "draft acc", "plain tok/s", "dflash tok/s", "speedup",
              "identical"]
    hf_on = report.hf_baseline.get("enabled")
    if hf_on:
        header.append("hf tok/s")
    summaries = list(report.sets.values())
    if len(summaries) > 1:
        summaries.append(report.overall)
    rows = []
    for s in summaries:
        row = [s.name, str(s.prompts), f"{s.tau_macro:.2f}", f"{s.tau_pooled:.2f}", f"{s.draft_acceptance:.1%}",
               f"{s.plain_tokens_per_second:.1f}", f"{s.dflash_tokens_per_second:.1f}",
               f"{s.speedup:.2f}x" if s.speedup is not None else "n/a", f"{s.identical}/{s.total}"]
        if hf_on:
            row.append(f"{s.hf_tokens_per_second:.1f}" if s.hf_tokens_per_second is not None else "n/a")
        rows.append(row)
    lines = columns([header, *rows], rule=True)
    lines.append("")
    lines.append("per-position draft acceptance (pooled; position 1 = first drafted token):")
    name_width = max(len(s.name) for s in summaries)
    for s in summaries:
        cells = " ".join(f"{p:.0%}" for p in s.per_position_acceptance) or "n/a"
        lines.append(f"  {s.name.ljust(name_width)}  {cells}")
    divergent = report.overall.divergences
    if divergent:
        shown = ", ".join(f"{d['set']}/{d['id']} at token {d['first_divergence']}" for d in divergent[:8])
        more = f" (+{len(divergent) - 8} more)" if len(divergent) > 8 else ""
        lines.append(f"outputs differ: {shown}{more}")
    st = report.settings
    notes = [f"adaptive blocks up to {st['block_size']}" if st.get("adaptive") else f"block {st['block_size']}",
             f"up to {st['max_new_tokens']} new tokens", "greedy",
             "chat template" if st["chat_template"] else "no chat template", f"warm-up {st['warmup']}",
             *([f"prompts filled to ~{st['context']} tokens with notes"] if st.get("context") else []),
             *([f"the drafter sees the last {st['draft_window']} tokens"] if st.get("draft_window") else []),
             "tau = tokens per verify step, bonus included (macro over responses)",
             "tok/s = decode only, prefill excluded"]
    lines.append("")
    lines.append(" · ".join(notes))
    if not hf_on:
        lines.append("hf assisted-generate column: off (a DFlash drafter cannot serve as a transformers "
                     "assistant_model)")
    return lines
