"""One-shot generation: the prompt from arguments, stdin and/or a file; text to stdout, the rest to stderr."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

import click

from dflash_cli.ui.render import (
    Output,
    OutputClosed,
    isatty,
    silence_stdout,
    stats_block,
    stats_json,
    status_text,
    summary_line,
)


def read_prompt(words: tuple[str, ...], file: str | None, stdin: Any, warn=lambda _: None) -> str:
    """stdin (when piped) or -f FILE first, then the instruction from the arguments (ollama and llm agree).

    All three are UTF-8: bytes that are not become U+FFFD, and `warn` is told once."""
    parts, replaced = [], False
    if file is not None:
        try:
            with open(file, "rb") as f:
                data, bad = decode_utf8(f.read())
        except OSError as e:
            raise click.BadParameter(f"cannot read {file}: {e.strerror}", param_hint="-f/--file") from None
        parts.append(data)
        replaced |= bad
    if stdin is not None and not isatty(stdin):
        raw = stdin.buffer.read() if hasattr(stdin, "buffer") else stdin.read()
        data, bad = decode_utf8(raw)
        if data.strip():
            parts.append(data)
            replaced |= bad
    if words:
        data, bad = decode_utf8(" ".join(words))
        parts.append(data)
        replaced |= bad
    prompt = "\n\n".join(p.rstrip("\n") for p in parts)
    if not prompt.strip():
        raise click.UsageError("no prompt: give it as arguments, pipe it on stdin, or use -f FILE")
    if replaced:
        warn(NOT_UTF8.format(what="the prompt"))
    return prompt


NOT_UTF8 = "{what} is not valid UTF-8: the invalid bytes were replaced with U+FFFD"


def decode_utf8(data: bytes | str) -> tuple[str, bool]:
    """(text, whether something was replaced). A str may hold the surrogate escapes Python gives to
    undecodable bytes in arguments, environment variables and C-locale streams: those become U+FFFD."""
    if isinstance(data, str):
        try:
            data.encode("utf-8")
            return data, False
        except UnicodeEncodeError:
            data = data.encode("utf-8", "surrogateescape" if _only_escapes(data) else "replace")
            return data.decode("utf-8", "replace"), True
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return data.decode("utf-8", "replace"), True


def _only_escapes(text: str) -> bool:
    return all(not 0xD800 <= ord(c) <= 0xDFFF or 0xDC80 <= ord(c) <= 0xDCFF for c in text)



def load_runtime_for(out: Output, opts: dict[str, Any], *, quiet: bool, prompt: str | None = None,
                     system: str | None = None):
    """Resolves the pair (registry, preflight, download on first use), then loads it with a spinner.

    What can be checked without the weights is checked first: --block-size against the drafter's config,
    and the length of `prompt` (generate's) against --max-context, with the tokenizer alone."""
    from dflash_cli.models.resolve import memory_budget, resolve_pair
    from dflash_cli.session import load_runtime

    if not opts.get("model"):
        raise click.UsageError("no model given: pass -m/--model (a folder, a known name such as qwen3-8b, "
                               "or a Hub repo id), or set DFLASH_MODEL")
    pair = resolve_pair(opts["model"], opts.get("draft"), no_draft=opts["no_draft"],
                        on_status=out.info if not quiet else (lambda _: None), quant=opts["quant"],
                        budget=memory_budget(opts["device"], opts["dtype"], opts["max_context"],
                                             opts.get("device_map"), opts.get("max_memory")))
    check_block_size(opts.get("block_size"), pair.block_size)
    if opts["quant"] == "auto" and not quiet:
        out.info(f"--quant auto: {auto_quant_reason(pair.quant, opts['device'])}")
    with out.spinner(f"Loading {opts['model']} ...") as spinner:
        def on_status(message: str) -> None:  # a long step of the load (compiling): said, on a pipe too
            if spinner is not None:
                spinner.update(message)
            elif not quiet:
                out.info(message)

        runtime = load_runtime(str(pair.target_dir), str(pair.drafter_dir) if pair.drafter_dir else None,
                               quant=pair.quant, quant_auto=pair.quant_auto, dtype=opts["dtype"],
                               device=opts["device"],
                               compile=opts.get("compile", "auto"), max_context=opts.get("max_context"),
                               device_map=opts.get("device_map"), max_memory=opts.get("max_memory"),
                               on_notice=out.warn, on_status=on_status,
                               before_weights=None if prompt is None else
                               lambda tokenizer: check_prompt_fits(tokenizer, prompt, system, opts))
    runtime.pair = pair.drafter_entry
    if not quiet:
        where = f"{runtime.device} {runtime.dtype}" + (f" {runtime.quant}" if runtime.quant else "")
        if runtime.target.split:
            where += f" · layers on {runtime.target.placement}"
        block = f" (block {runtime.drafter.block_size})" if runtime.speculative else ""
        out.info(f"{pair.drafter_note}{block} · {where} · loaded in {runtime.load_seconds:.1f}s")
    return runtime


def auto_quant_reason(chosen: str, device: str | None) -> str:
    """What --quant auto chose, and why: on a CPU the format measured fastest there, else what fits."""
    from dflash_cli.engine.device import cpu_auto_quant, pick_device

    if pick_device(device).type == "cpu":
        return f"{chosen if chosen != 'none' else 'no quantization'} ({cpu_auto_quant()[1]})"
    return f"{chosen if chosen != 'none' else 'no quantization'} fits"


def connect_engine(out: Output, opts: dict[str, Any], *, quiet: bool):
    """--engine URL: the server in the place of a loaded pair (remote.py); -m names its model."""
    from dflash_cli import settings as S
    from dflash_cli.remote import RemoteRuntime, redact_url

    if opts.get("draft") and not quiet:
        out.warn("--draft is ignored with --engine: the server runs its own drafter")
    # what only a local model uses: said once, not dropped without a word (--hide-thinking, --think and the
    # sampling options apply to a remote reply too)
    local = {"--block-size": opts.get("block_size") is not None,
             "--quant": opts.get("quant") not in (None, "none"),
             "--dtype": opts.get("dtype") not in (None, S.DEFAULT_DTYPE),
             "--device": opts.get("device") not in (None, S.DEFAULT_DEVICE),
             "--compile": opts.get("compile") not in (None, S.DEFAULT_COMPILE),
             "--max-context": opts.get("max_context") not in (None, S.DEFAULT_MAX_CONTEXT),
             "--no-chat-template": bool(opts.get("no_chat_template")),
             "--device-map": opts.get("device_map") not in (None, S.DEFAULT_DEVICE_MAP),
             "--max-memory": opts.get("max_memory") is not None,
             "--no-draft": bool(opts.get("no_draft"))}
    ignored = [name for name, given in local.items() if given]
    if ignored and not quiet:
        out.warn(f"{', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} ignored with --engine: "
                 "the server loads and runs the model, with its own chat template")
    with out.spinner(f"Connecting to {redact_url(opts['engine'])} ..."):  # never the password, even here
        runtime = RemoteRuntime(opts["engine"], opts.get("model"), S.api_key(), timeout=opts.get("timeout"))
    if not quiet:
        out.info(f"{runtime.model} on the engine at {runtime.url}")
    return runtime


WAITING = "waiting for the engine's first token (Ctrl-C stops)"


def check_block_size(block_size: int | None, trained: int | None) -> None:
    from dflash_cli.engine.errors import InvalidSettingError

    if block_size is None or (trained is not None and 1 <= block_size <= trained) or block_size == 1:
        return
    if trained is None:
        raise InvalidSettingError("--block-size needs a drafter", hint="drop --block-size or add --draft")
    raise InvalidSettingError(f"block size {block_size} is outside 1..{trained} (this drafter's trained block size)",
                              hint=f"use --block-size 1..{trained}, or leave it out for {trained}")


def check_prompt_fits(tokenizer: Any, prompt: str, system: str | None, opts: dict[str, Any]) -> None:
    from dflash_cli.engine.errors import InvalidSettingError
    from dflash_cli.engine.text import encode_prompt

    n = len(encode_prompt(tokenizer, prompt, chat_template=not opts["no_chat_template"],
                          enable_thinking=opts["think"], system=system))
    if opts.get("max_context") and n >= opts["max_context"]:
        raise InvalidSettingError(f"the prompt has {n} tokens, --max-context holds {opts['max_context']}",
                                  hint="shorten the prompt, or raise --max-context")


def system_prompt(out: Output, opts: dict[str, Any]) -> str | None:
    """-s/--system (or DFLASH_SYSTEM), with bytes that are not UTF-8 replaced as in the prompt."""
    if opts.get("system") is None:
        return None
    text, replaced = decode_utf8(opts["system"])
    if replaced:
        out.warn(NOT_UTF8.format(what="the system prompt"))
    return text


def check_thinking(out: Output, runtime: Any, think: bool | None, *, chat_template: bool = True,
                   drafter: bool = True) -> None:
    """Warns when the think setting cannot apply, and (`drafter`) when the thinking mode differs from the
    one the registry says the drafter was trained with."""
    from dflash_cli.engine.text import supports_thinking

    if think is not None and not supports_thinking(runtime.tokenizer):
        out.warn("this model's chat template has no thinking switch: the think setting is ignored")
    warning = drafter_thinking_warning(runtime, think) if drafter and chat_template else None
    if warning:
        out.warn(warning)


def effective_thinking(runtime: Any, think: bool | None) -> bool | None:
    """The thinking mode a reply runs in: the setting, else the chat template's default (None: unknown)."""
    from dflash_cli.engine.text import supports_thinking, thinking_default

    if not supports_thinking(runtime.tokenizer):
        return None
    return think if think is not None else thinking_default(runtime.tokenizer)


def drafter_thinking_warning(runtime: Any, think: bool | None) -> str | None:
    pair = getattr(runtime, "pair", None)
    if pair is None or pair.thinking is None or not runtime.speculative:
        return None
    mode = effective_thinking(runtime, think)
    if mode is None or mode == pair.thinking:
        return None
    trained, chosen = ("on", "off") if pair.thinking else ("off", "on")
    switch = "think" if pair.thinking else "no-think"
    return (f"the drafter for {pair.alias} was trained with thinking {trained}: with thinking {chosen}, expect "
            f"lower acceptance (fewer tokens per step); --{switch} (chat: /set {switch.replace('-', '')}) "
            "matches its training")


def run_generate(out: Output, opts: dict[str, Any], prompt: str, *, compare: bool, as_json: bool) -> int:
    """Streams one reply. Returns the exit code (0, or 130 when interrupted)."""
    from dflash_cli.session import Conversation
    from dflash_cli.ui.common import generation_settings

    quiet = opts["quiet"] or (as_json and not opts["verbose"])  # --json -v: the JSON, and -v's lines on stderr
    system = system_prompt(out, opts)
    remote = bool(opts.get("engine"))
    runtime = _open_runtime(out, opts, prompt, system, quiet=quiet, compare=compare)
    out.hide_thinking = opts["hide_thinking"]
    settings = generation_settings(opts)
    if settings.temperature > 0 and settings.seed is None:
        # a fresh seed, reported by --json/--verbose so the run can be replayed; --compare reuses it
        settings.seed = secrets.randbits(31)
    if compare:
        if not runtime.speculative:
            raise click.UsageError("--compare needs a drafter (--draft FOLDER)")
        _warm_up(runtime, settings)
    if not quiet and not compare and not remote:
        out.legend()
    conversation = runtime.conversation(system) if remote else Conversation(runtime, system=system)
    started = time.perf_counter()
    status = None if quiet else out.status_line()
    last, tokens, interrupted = None, [], False
    try:
        steps = conversation.ask(prompt, settings)
        if remote:  # a server's queue and prefill can take long: said on the status line, not silent
            steps = out.until_first(steps, WAITING)
        out.begin_reply(conversation.reply_in_thinking)
        for step in steps:
            last = step
            tokens.extend(step.tokens)
            if not as_json:
                out.text(step)
            if status is not None:
                status.update(status_text(step.stats, runtime.speculative, out.color_err))
    except KeyboardInterrupt:
        interrupted = True
    except OutputClosed:
        silence_stdout()
        return 0
    except Exception:
        if not as_json:  # the text received so far ends on a fresh line before the error
            out.end_text()
        raise
    finally:
        out.close_status()
    if not as_json:
        out.end_text()
    wall = time.perf_counter() - started
    if last is None:
        out.info("interrupted")
        return 130
    stats = last.stats
    baseline = None
    if compare and not interrupted:
        baseline = _baseline(runtime, conversation, settings)
    if as_json:
        data = _reply_json(runtime, conversation, stats, settings, interrupted)
        if baseline is not None:
            data.update(_comparison(tokens, stats, baseline))
        out.write_out(json.dumps(data, ensure_ascii=False) + "\n")
    if opts["verbose"]:
        for line in stats_block(stats, load_seconds=runtime.load_seconds, wall_seconds=wall,
                                baseline=baseline[1] if baseline else None, forward=runtime.fast_path,
                                seed=settings.seed):
            out.info(line, dim=False)
    elif not quiet and out.err_tty:
        out.info(summary_line(stats, runtime.speculative))
    if baseline is not None and not as_json:
        out.info(_compare_line(runtime, tokens, stats, baseline), dim=False)
    if stats.finish_reason == "context" and not opts["quiet"]:
        out.warn(f"the reply stopped after {stats.generated_tokens} tokens: the context is full "
                 f"({stats.prompt_tokens + stats.generated_tokens} tokens); raise --max-context for longer replies")
    if interrupted:
        out.info("interrupted")
        return 130
    return 0


def reply_json(conversation: Any) -> dict[str, Any]:
    """--json's text: the answer; the reasoning of a thinking model under 'thinking' (else null)."""
    from dflash_cli.ui.thinking import split_reply

    reply, inside = conversation.messages[-1]["content"], conversation.reply_in_thinking
    thinking, answer = split_reply(reply, inside) if inside is not None else (None, reply)
    return {"text": answer, "thinking": thinking}


def _open_runtime(out: Output, opts: dict[str, Any], prompt: str, system: str | None, *, quiet: bool,
                  compare: bool):
    """The remote engine (--engine) or the loaded pair, its thinking switch checked."""
    if opts.get("engine"):
        if compare:
            raise click.UsageError("--compare runs plain decoding here: it cannot be used with --engine")
        return connect_engine(out, opts, quiet=quiet)
    runtime = load_runtime_for(out, opts, quiet=quiet, prompt=prompt, system=system)
    check_thinking(out, runtime, opts["think"], chat_template=not opts["no_chat_template"])
    return runtime


def _reply_json(runtime: Any, conversation: Any, stats: Any, settings: Any, interrupted: bool) -> dict[str, Any]:
    """--json's object: the reply, its statistics, what produced it."""
    data = {**reply_json(conversation), **stats_json(stats), "interrupted": interrupted,
            "model": str(runtime.target_dir), "drafter": str(runtime.drafter_dir) if runtime.drafter_dir else None,
            "forward": runtime.fast_path, "seed": settings.seed}
    if interrupted:
        data["finish_reason"] = "interrupted"
    return data


def _compare_line(runtime: Any, tokens: list[int], stats: Any, baseline: tuple[list[int], Any]) -> str:
    """--compare's line: both speeds, and whether the outputs match (and whether a mismatch is expected)."""
    cmp = _comparison(tokens, stats, baseline)
    if cmp["identical"]:
        same = f"identical output ({len(tokens)}/{len(tokens)} tokens)"
    else:
        same = f"first divergence at token {cmp['first_divergence']}"
        fast = getattr(runtime.target, "fast", None)
        if runtime.quant in ("q4", "q8") and fast is not None and fast.row_exact:
            same += f" (not expected with {runtime.quant}, whose rows are exact: please report it)"
        elif runtime.quant in ("q4", "q8"):
            same += f" (expected now and then with {runtime.quant} on {runtime.dtype} activations, rounded " \
                    "to bf16 at every linear; without --dtype float32 the output is exact)"
        elif runtime.dtype != "float32" or runtime.quant:
            same += f" (expected now and then in {runtime.quant or runtime.dtype}: a block forward and a " \
                    "1-token forward round differently; float32, and q4/q8 in bf16, are exact)"
    return (f"compare: speculative {stats.decode_tokens_per_second:.1f} tok/s vs plain "
            f"{cmp['baseline']['decode_tokens_per_second']:.1f} tok/s = {cmp['speedup']:.2f}x · {same}")


def _warm_up(runtime: Any, settings: Any) -> None:
    """A few tokens of both modes first, so neither side of --compare pays one-time costs."""
    from dflash_cli.engine.generate import generate

    ids = runtime.tokenizer.encode("Hello", add_special_tokens=False) or [0]
    for drafter in (runtime.drafter, None):
        generate(runtime.target, drafter, ids, max_new_tokens=4, stop_ids=[])


def _baseline(runtime: Any, conversation: Any, settings: Any) -> tuple[list[int], Any]:
    from dflash_cli.engine.generate import generate

    # the conversation now ends with the reply: rebuild the prompt that produced it
    messages, conversation.messages = conversation.messages, conversation.messages[:-1]
    try:
        prompt = conversation.prompt_ids(settings)
    finally:
        conversation.messages = messages
    # plain decoding has no blocks: --block-size shapes only the speculative side
    result = generate(runtime.target, None, prompt, **{**settings.engine_kwargs(), "block_size": None})
    return result.tokens, result.stats


def _comparison(tokens: list[int], stats: Any, baseline: tuple[list[int], Any]) -> dict[str, Any]:
    """Speed and sameness of the two runs (sampled runs share one seed, so they must match too)."""
    base_tokens, base_stats = baseline
    from dflash_cli.engine.response import first_divergence

    diverge = first_divergence(tokens, base_tokens)
    rate = base_stats.decode_tokens_per_second
    return {"baseline": stats_json(base_stats),
            "speedup": stats.decode_tokens_per_second / rate if rate else None,
            "identical": diverge is None,
            "first_divergence": diverge}
