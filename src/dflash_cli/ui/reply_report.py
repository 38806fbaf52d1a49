"""What `generate` says after a reply: the --json object, the -v statistics block or the summary line,
--compare's line, and the warning when the context filled up."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflash_cli.ui.render import Output
from dflash_cli.ui.stats_text import stats_block, stats_json, summary_line

if TYPE_CHECKING:
    from dflash_cli.runtime import Runtime


@dataclass
class Reply:
    """A finished (or interrupted) reply and what produced it."""

    runtime: Runtime
    conversation: Any
    tokens: list[int]
    stats: Any
    settings: Any
    interrupted: bool
    wall_seconds: float
    baseline: tuple[list[int], Any] | None = None  # --compare: plain decoding's tokens and statistics


def report_reply(out: Output, reply: Reply, *, as_json: bool, verbose: bool, quiet: bool, silent: bool) -> None:
    """`quiet`: no summary line (-q, or --json without -v); `silent`: -q, not even the context warning."""
    runtime, stats, baseline = reply.runtime, reply.stats, reply.baseline
    if as_json:
        data = reply_object(reply)
        if baseline is not None:
            data.update(comparison(reply.tokens, stats, baseline))
        out.write_out(json.dumps(data, ensure_ascii=False) + "\n")
    if verbose:
        for line in stats_block(stats, load_seconds=runtime.load_seconds, wall_seconds=reply.wall_seconds,
                                baseline=baseline[1] if baseline else None, forward=runtime.forward,
                                seed=reply.settings.seed):
            out.info(line, dim=False)
    elif not quiet and out.err_tty:
        out.info(summary_line(stats, runtime.speculative))
    if baseline is not None and not as_json:
        out.info(compare_line(runtime, reply.tokens, stats, baseline), dim=False)
    if stats.finish_reason == "context" and not silent:
        out.warn(f"the reply stopped after {stats.generated_tokens} tokens: the context is full "
                 f"({stats.prompt_tokens + stats.generated_tokens} tokens); raise --max-context for longer replies")


def reply_json(conversation: Any) -> dict[str, Any]:
    """--json's text: the answer; the reasoning of a thinking model under 'thinking' (else null)."""
    from dflash_cli.engine.thinking import split_reply

    text, inside = conversation.messages[-1]["content"], conversation.reply_in_thinking
    thinking, answer = split_reply(text, inside, conversation.reply_markers) if inside is not None else (None, text)
    return {"text": answer, "thinking": thinking}


def reply_object(reply: Reply) -> dict[str, Any]:
    """--json's object: the reply, its statistics, what produced it."""
    runtime = reply.runtime
    data = {**reply_json(reply.conversation), **stats_json(reply.stats), "interrupted": reply.interrupted,
            "model": runtime.model_name, "drafter": runtime.drafter_name, "forward": runtime.forward,
            "seed": reply.settings.seed}
    if reply.interrupted:
        data["finish_reason"] = "interrupted"
    return data


def compare_line(runtime: Runtime, tokens: list[int], stats: Any, baseline: tuple[list[int], Any]) -> str:
    """--compare's line: both speeds, and whether the outputs match (and whether a mismatch is expected)."""
    from dflash_cli.runtime.local import LocalRuntime

    assert isinstance(runtime, LocalRuntime)  # --compare runs only here
    cmp = comparison(tokens, stats, baseline)
    if cmp["identical"]:
        same = f"identical output ({len(tokens)}/{len(tokens)} tokens)"
    else:
        same = f"first divergence at token {cmp['first_divergence']}"
        fast = getattr(runtime.target, "fast", None)
        if runtime.quant in ("q4", "q8", "q4a8", "q8a8") and fast is not None and fast.row_exact:
            same += f" (not expected with {runtime.quant}, whose rows are exact: please report it)"
        elif runtime.quant in ("q4", "q8"):
            same += f" (expected now and then with {runtime.quant} on {runtime.dtype} activations, rounded " \
                    "to bf16 at every linear; without --dtype float32 the output is exact)"
        elif runtime.dtype != "float32" or runtime.quant:
            same += f" (expected now and then in {runtime.quant or runtime.dtype}: a block forward and a " \
                    "1-token forward round differently; float32, and q4/q8 in bf16, are exact)"
    return (f"compare: speculative {stats.decode_tokens_per_second:.1f} tok/s vs plain "
            f"{cmp['baseline']['decode_tokens_per_second']:.1f} tok/s = {cmp['speedup']:.2f}x · {same}")


def comparison(tokens: list[int], stats: Any, baseline: tuple[list[int], Any]) -> dict[str, Any]:
    """Speed and sameness of the two runs (sampled runs share one seed, so they must match too)."""
    from dflash_cli.engine.response import first_divergence

    base_tokens, base_stats = baseline
    diverge = first_divergence(tokens, base_tokens)
    rate = base_stats.decode_tokens_per_second
    return {"baseline": stats_json(base_stats),
            "speedup": stats.decode_tokens_per_second / rate if rate else None,
            "identical": diverge is None,
            "first_divergence": diverge}
