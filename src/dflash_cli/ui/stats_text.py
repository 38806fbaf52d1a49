"""A reply's statistics in words: the line after each chat reply, -v's labelled block (ollama's rows plus
the speculative ones) and --json's keys. The live status line's text is render.status_text."""

from __future__ import annotations

from typing import Any

from dflash_cli.units import fmt_bytes

NOT_REPORTED = "acceptance not reported by the server"


def fmt_seconds(s: float) -> str:
    return f"{s * 1000:.0f}ms" if s < 1 else f"{s:.2f}s"


# C0 controls but tab and newline, DEL, and the C1 controls (0x9b is a one-byte CSI)


def block_summary(stats: Any) -> str:
    """'block 16', or for adaptive runs the block sizes used: 'blocks 16x40 8x3, paused 5 steps'."""
    if not stats.adaptive:
        return f"block {stats.block_size}"
    used = [f"{n + 1}x{count}" for n, count in reversed(list(enumerate(stats.block_rounds))) if count and n > 0]
    paused = stats.block_rounds[0] if stats.block_rounds else 0
    text = "adaptive blocks " + (" ".join(used) if used else "none")
    return text + (f", paused {paused} step(s)" if paused else "")


def summary_line(stats: Any, speculative: bool) -> str:
    """The compact line after each chat reply."""
    parts = [f"{stats.generated_tokens} tokens", f"{stats.decode_tokens_per_second:.1f} tok/s",
             f"{stats.prefill_seconds + stats.decode_seconds:.1f}s"]
    if not getattr(stats, "acceptance_reported", True):
        parts.append(NOT_REPORTED)
    elif speculative:
        parts += [f"τ {stats.acceptance_length:.2f}"]
        if stats.drafted:
            parts.append(f"draft acceptance {stats.draft_acceptance:.0%}")
        if stats.committed_histogram or not stats.counted_decode_tokens:
            parts.append(block_summary(stats))
    else:
        parts.append("speculation off")
    if stats.finish_reason == "length":
        parts.append("stopped at the token limit")
    elif stats.finish_reason == "context":
        parts.append("stopped: the context is full")
    return " · ".join(parts)


def stats_block(stats: Any, *, load_seconds: float | None = None, wall_seconds: float | None = None,
                baseline: Any = None, forward: str | None = None, seed: int | None = None) -> list[str]:
    """ollama-style labelled statistics, extended with the speculative rows (and the forward used)."""
    rows: list[tuple[str, str]] = []
    if wall_seconds is not None:
        rows.append(("total duration", fmt_seconds(wall_seconds)))
    if load_seconds is not None:
        rows.append(("load duration", fmt_seconds(load_seconds)))
    if forward is not None:
        rows.append(("forward", forward))
    if seed is not None:
        rows.append(("seed", str(seed)))
    rate = stats.prefilled_tokens / stats.prefill_seconds if stats.prefill_seconds else 0.0
    rows += [("prompt eval count", f"{stats.prompt_tokens} token(s)"
              + (f" ({stats.prompt_tokens - stats.prefilled_tokens} reused from cache)"
                 if stats.prefilled_tokens < stats.prompt_tokens else "")),
             ("prompt eval duration", fmt_seconds(stats.prefill_seconds)),
             ("prompt eval rate", f"{rate:.2f} tokens/s"),
             ("eval count", f"{stats.generated_tokens} token(s)"),
             ("eval duration", fmt_seconds(stats.decode_seconds)),
             ("eval rate", f"{stats.decode_tokens_per_second:.2f} tokens/s")]
    if not getattr(stats, "acceptance_reported", True):
        rows.append(("speculation", NOT_REPORTED))
    elif stats.counted_decode_tokens is not None:  # a remote engine's counters (runtime/remote.py)
        rows += [("acceptance length", f"{stats.acceptance_length:.2f} tokens/step (tau, bonus included)"
                  if stats.steps else "not reported by the server"),
                 ("draft acceptance", f"{stats.draft_acceptance:.1%} ({stats.accepted}/{stats.drafted} drafted)"
                  if stats.drafted else "not reported by the server"),
                 ("steps", str(stats.steps))]
        if stats.position_drafted:
            rows.append(("per-position accept",
                         " ".join(f"{k + 1}:{p:.0%}" for k, p in enumerate(stats.per_position_acceptance))))
    elif stats.speculative:
        other = max(stats.decode_seconds - stats.draft_seconds - stats.verify_seconds, 0.0)
        per_pos = " ".join(f"{k + 1}:{p:.0%}" for k, p in enumerate(stats.per_position_acceptance))
        rows += [("speculation", f"on, {block_summary(stats)} (trained block {stats.block_size})"),
                 *([("paused because", stats.pause_reason)] if getattr(stats, "pause_reason", "") else []),
                 ("acceptance length", f"{stats.acceptance_length:.2f} tokens/step (tau, bonus included)"),
                 ("draft acceptance", f"{stats.draft_acceptance:.1%} ({stats.accepted}/{stats.drafted} drafted)"),
                 ("steps", str(stats.steps)),
                 ("per-position accept", per_pos),
                 ("draft / verify time", f"{fmt_seconds(stats.draft_seconds)} / "
                  f"{fmt_seconds(stats.verify_seconds)} (+{fmt_seconds(other)} loop)")]
    else:
        rows.append(("speculation", "off"))
    if baseline is not None and baseline.decode_tokens_per_second > 0:
        speedup = stats.decode_tokens_per_second / baseline.decode_tokens_per_second
        rows += [("plain eval rate", f"{baseline.decode_tokens_per_second:.2f} tokens/s"),
                 ("speedup", f"{speedup:.2f}x (measured against plain decoding)")]
    if getattr(stats, "draft_window", 0):
        rows.append(("draft window", f"the last {stats.draft_window} tokens of context"))
    if getattr(stats, "threads", 0):
        changed = stats.thread_changes
        rows.append(("cpu threads", f"{stats.threads}" + (f" (changed {changed} time(s) as other processes took or "
                                                          "freed cores)" if changed else "")))
    if stats.peak_memory_bytes is not None:
        rows.append(("peak memory", f"{fmt_bytes(stats.peak_memory_bytes)} ({stats.peak_memory_kind})"))
    width = max(len(k) for k, _ in rows) + 1
    return [f"{k + ':':<{width}} {v}" for k, v in rows]


def stats_json(stats: Any) -> dict[str, Any]:
    """The documented --json keys (stable names for scripts) plus the raw counters."""
    if not getattr(stats, "acceptance_reported", True):  # null, not zeros: the server said nothing
        data = _stats_json(stats)
        for key in ("steps", "drafted", "accepted", "acceptance_length", "draft_acceptance"):
            data[key] = None
        data["acceptance_reported"] = False
        return data
    data = _stats_json(stats)
    if getattr(stats, "counted_decode_tokens", None) is not None and not stats.drafted:
        # a remote engine that counted its steps but not its drafts (old SGLang): null, as -v says
        data["drafted"] = data["draft_acceptance"] = None
    return data


def _stats_json(stats: Any) -> dict[str, Any]:
    return {
        "finish_reason": stats.finish_reason,
        "prompt_tokens": stats.prompt_tokens,
        "prefilled_tokens": stats.prefilled_tokens,
        "generated_tokens": stats.generated_tokens,
        "steps": stats.steps,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "block_size": stats.block_size,
        "adaptive": stats.adaptive,
        "block_rounds": list(stats.block_rounds),
        "last_block": stats.last_block,
        "speculative": stats.speculative,
        "acceptance_length": stats.acceptance_length,
        "draft_acceptance": stats.draft_acceptance,
        "per_position_acceptance": list(stats.per_position_acceptance),
        "committed_histogram": list(stats.committed_histogram),
        "prefill_seconds": stats.prefill_seconds,
        "time_to_first_token_seconds": stats.time_to_first_token,
        "decode_seconds": stats.decode_seconds,
        "draft_seconds": stats.draft_seconds,
        "verify_seconds": stats.verify_seconds,
        "decode_tokens_per_second": stats.decode_tokens_per_second,
        "peak_memory_bytes": stats.peak_memory_bytes,
        "peak_memory_kind": stats.peak_memory_kind,
        "threads": getattr(stats, "threads", 0) or None,
        "thread_changes": getattr(stats, "thread_changes", 0),
        "pause_reason": getattr(stats, "pause_reason", "") or None,
        "draft_window": getattr(stats, "draft_window", 0) or None,
    }
