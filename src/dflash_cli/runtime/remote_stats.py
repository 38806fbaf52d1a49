"""What a remote engine reports about acceptance, and the per-reply `Counters` that turn it into statistics.

Acceptance statistics come from what the server reports, and from nothing else:
- SGLang's per-request `meta_info` (`spec_verify_ct`: verify steps; `spec_num_proposed_drafts` /
  `spec_num_correct_drafts` or the older `spec_draft_token_num` / `spec_accept_token_num`), read from a
  stream chunk that carries it (at the top level, in a choice, or in `usage`);
- this request's own `usage.metrics.speculative_decoding` in the final usage chunk (`dflash-cli serve`,
  and vLLM with per-request metrics): `num_spec_steps`, `num_draft_tokens`, `num_accepted_draft_tokens`,
  `num_accepted_tokens_per_pos`;
- as a fallback, vLLM's Prometheus counters on /metrics (`vllm:spec_decode_num_drafts_total`,
  `vllm:spec_decode_num_draft_tokens_total`, `vllm:spec_decode_num_accepted_tokens_total`,
  `vllm:spec_decode_num_accepted_tokens_per_pos_total{position="k"}`), read before and after the request and
  differenced. They are server-wide: other clients' requests in the same interval are counted too;
- last, SGLang's `sglang:spec_accept_length` gauge on /metrics (the server's mean acceptance length over its
  latest logging interval, every client's requests): tau only, the verify steps estimated from the streamed
  tokens, no drafted count.
Where none is there, the stats say `acceptance_reported=False` and the terminal says so.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

from dflash_cli.engine.response import GenerationStats

# -- vLLM's Prometheus counters -----------------------------------------------------------------------

VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
SGLANG_ACCEPT_LENGTH = "sglang:spec_accept_length"  # a gauge, 0 on a server that does not speculate
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_spec_counters(text: str) -> dict[str, Any]:
    """vLLM's spec_decode counters in a Prometheus text exposition, summed over label sets (engines, models);
    per-position ones under 'per_pos' {position: count}; SGLang's acceptance-length gauge, the mean of its
    label sets (ranks) that report one. {} when the server exports none."""
    out: dict[str, Any] = {}
    lengths: list[float] = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None or not match.group(1).startswith(("vllm:spec_decode_", SGLANG_ACCEPT_LENGTH)):
            continue
        name, labels, raw = match.groups()
        try:
            value = float(raw)
        except ValueError:
            continue
        if name == SGLANG_ACCEPT_LENGTH:
            if math.isfinite(value) and value >= 1.0:  # tau counts the target's own token: below 1 is no data
                lengths.append(value)
        elif name == VLLM_PER_POS:
            pos = re.search(r'position="(\d+)"', labels or "")
            if pos is not None:
                per = out.setdefault("per_pos", {})
                per[int(pos.group(1))] = per.get(int(pos.group(1)), 0.0) + value
        elif name in (VLLM_DRAFTS, VLLM_DRAFT_TOKENS, VLLM_ACCEPTED):
            out[name] = out.get(name, 0.0) + value
    if lengths:
        out[SGLANG_ACCEPT_LENGTH] = sum(lengths) / len(lengths)
    return out


def counter_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any] | None:
    """after - before; None when the counters are missing or moved backwards (a restarted server). A server
    with SGLang's gauge and no counters: the gauge as it is after the request (a gauge has no difference)."""
    if not after or VLLM_DRAFTS not in after:
        return {SGLANG_ACCEPT_LENGTH: after[SGLANG_ACCEPT_LENGTH]} if SGLANG_ACCEPT_LENGTH in after else None
    delta: dict[str, Any] = {k: after[k] - before.get(k, 0.0) for k in (VLLM_DRAFTS, VLLM_DRAFT_TOKENS, VLLM_ACCEPTED)
                             if k in after}
    per_after, per_before = after.get("per_pos", {}), before.get("per_pos", {})
    delta["per_pos"] = {k: v - per_before.get(k, 0.0) for k, v in per_after.items()}
    if any(v < 0 for k, v in delta.items() if k != "per_pos") or any(v < 0 for v in delta["per_pos"].values()):
        return None
    return delta




def find_meta_info(chunk: dict[str, Any]) -> dict[str, Any] | None:
    """SGLang's meta info in a stream chunk, wherever this server version puts it."""
    places = [chunk.get("meta_info"), chunk.get("usage")]
    for choice in chunk.get("choices") or []:
        if isinstance(choice, dict):
            places.append(choice.get("meta_info"))
    for place in places:
        if isinstance(place, dict) and "spec_verify_ct" in place:
            return place
    return None



@dataclass
class Counters:
    """What the stream and the server reported so far about one reply."""

    started: float
    first_at: float | None = None
    last_at: float | None = None
    chunks: int = 0
    prompt_tokens: int = 0
    completion_tokens: int | None = None
    finish_reason: str | None = None
    meta: dict[str, Any] | None = None
    request_spec: dict[str, Any] | None = None  # usage.metrics.speculative_decoding (dflash-cli serve, vLLM)
    metrics: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    reasoning: bool = False  # inside reasoning sent apart from the content (a server's reasoning parser)

    def stats(self, final: bool = True) -> GenerationStats:
        """The figures so far; before the end (`final` False) the server has reported nothing yet."""
        generated = self.completion_tokens if self.completion_tokens is not None else self.chunks
        prefill = (self.first_at - self.started) if self.first_at is not None else time.perf_counter() - self.started
        decode = (self.last_at - self.first_at) if self.first_at is not None and self.last_at is not None else 0.0
        steps = drafted = accepted = 0
        block, reported = 1, False
        pos_drafted: tuple[int, ...] = ()
        pos_accepted: tuple[int, ...] = ()
        histogram: tuple[int, ...] = ()
        if self.meta is not None:
            reported = True
            steps = int(self.meta.get("spec_verify_ct") or 0)
            drafted = int(self.meta.get("spec_num_proposed_drafts", self.meta.get("spec_draft_token_num")) or 0)
            correct = self.meta.get("spec_num_correct_drafts", self.meta.get("spec_accept_token_num"))
            # each verify step commits its accepted drafts plus one token of the target's own
            accepted = int(correct) if correct is not None else max(generated - 1 - steps, 0)
            block = 2
        elif self.request_spec is not None:
            reported = True
            spec = self.request_spec
            steps, drafted = int(spec.get("num_spec_steps") or 0), int(spec.get("num_draft_tokens") or 0)
            accepted = int(spec.get("num_accepted_draft_tokens") or 0)
            pos_accepted = tuple(int(n) for n in spec.get("num_accepted_tokens_per_pos") or ())
            pos_drafted = (steps,) * len(pos_accepted)
            # dflash-cli serve sends block_size; vLLM num_spec_tokens (drafts per step) and the histogram
            drafts = spec.get("num_spec_tokens")
            block = int(spec.get("block_size") or (drafts + 1 if drafts else len(pos_accepted) + 1))
            histogram = tuple(int(n) for n in spec.get("acceptance_histogram") or ())
        elif self.metrics is not None and SGLANG_ACCEPT_LENGTH in self.metrics:
            reported, block = True, 2
            decode = max(generated - 1, 0)
            steps = max(round(decode / self.metrics[SGLANG_ACCEPT_LENGTH]), 1) if decode else 0
            accepted = max(decode - steps, 0)
        elif self.metrics is not None:
            reported = True
            steps = int(self.metrics.get(VLLM_DRAFTS, 0))
            drafted = int(self.metrics.get(VLLM_DRAFT_TOKENS, 0))
            accepted = int(self.metrics.get(VLLM_ACCEPTED, 0))
            per = self.metrics.get("per_pos", {})
            if per:
                k = max(per) + 1
                pos_accepted = tuple(int(per.get(i, 0)) for i in range(k))
                pos_drafted = (steps,) * k
                # acceptance stops at the first rejected draft: steps accepting >= j drafts = accepted at j-1
                at_least = (steps, *pos_accepted)
                histogram = tuple(max(at_least[j] - (at_least[j + 1] if j + 1 < len(at_least) else 0), 0)
                                  for j in range(len(at_least)))
                block = k + 1
            else:
                block = 2
        return GenerationStats(
            prompt_tokens=self.prompt_tokens, prefilled_tokens=self.prompt_tokens, prefill_seconds=prefill,
            generated_tokens=generated, decode_seconds=decode, steps=steps, drafted=drafted, accepted=accepted,
            draft_seconds=0.0, verify_seconds=0.0, block_size=block, committed_histogram=histogram,
            position_drafted=pos_drafted, position_accepted=pos_accepted, peak_memory_bytes=None,
            peak_memory_kind="", finish_reason=self.finish_reason, acceptance_reported=reported,
            counted_decode_tokens=max(generated - 1, 0)) if final or reported else GenerationStats(
            prompt_tokens=self.prompt_tokens, prefilled_tokens=self.prompt_tokens, prefill_seconds=prefill,
            generated_tokens=generated, decode_seconds=decode, steps=0, drafted=0, accepted=0, draft_seconds=0.0,
            verify_seconds=0.0, block_size=1, committed_histogram=(), position_drafted=(), position_accepted=(),
            peak_memory_bytes=None, peak_memory_kind="", counted_decode_tokens=max(generated - 1, 0))
