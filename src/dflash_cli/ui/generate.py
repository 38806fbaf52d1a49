"""`generate`'s body: one reply streamed to stdout, the rest to stderr (the reports: ui/reply_report.py)."""

from __future__ import annotations

import dataclasses
import secrets
import time
from typing import TYPE_CHECKING, Any

import click

from dflash_cli.ui.opening import check_format, check_thinking, open_model
from dflash_cli.ui.prompt_input import system_prompt
from dflash_cli.ui.render import Output, OutputClosed, silence_stdout, status_text
from dflash_cli.ui.reply_report import Reply, report_reply

if TYPE_CHECKING:
    from dflash_cli.runtime import Runtime


def run_generate(out: Output, command: Any, prompt: str, *, compare: bool, as_json: bool) -> int:
    """Streams one reply (`command`: ui.options.CommandOptions). Returns the exit code (0, or 130 when
    interrupted)."""
    shown = command.output
    quiet = shown.quiet or (as_json and not shown.verbose)  # --json -v: the JSON, and -v's lines on stderr
    if compare and command.model.engine:
        raise click.UsageError("--compare runs plain decoding here: it cannot be used with --engine")
    system = system_prompt(out, command.system)
    settings = dataclasses.replace(command.settings)
    runtime = open_model(out, command.model, quiet=quiet, settings=settings,
                         before_weights=lambda tokenizer: check_prompt_fits(tokenizer, prompt, system, settings))
    try:
        check_format(settings)
        check_thinking(out, runtime, settings.think, chat_template=settings.chat_template)
        out.hide_thinking = shown.hide_thinking
        if settings.temperature > 0 and settings.seed is None:
            # a fresh seed, reported by --json/--verbose so the run can be replayed; --compare reuses it
            settings.seed = secrets.randbits(31)
        if compare:
            _warm_up_both(runtime)
        if not quiet and not compare and runtime.marks_drafted:
            out.legend()
        return _answer(out, runtime, runtime.conversation(system), prompt, settings, command.output,
                       quiet=quiet, compare=compare, as_json=as_json)
    finally:
        runtime.close()


def _answer(out: Output, runtime: Runtime, conversation: Any, prompt: str, settings: Any, shown: Any, *, quiet: bool,
            compare: bool, as_json: bool) -> int:
    """Streams the reply, then reports it; the exit code."""
    started = time.perf_counter()
    streamed = stream_reply(out, runtime, conversation, prompt, settings, quiet=quiet, as_json=as_json)
    if streamed is None:  # stdout was closed (a pager quit): nothing more to say
        return 0
    last, tokens, interrupted = streamed
    if last is None:
        out.info("interrupted")
        return 130
    baseline = _baseline(runtime, conversation, settings) if compare and not interrupted else None
    reply = Reply(runtime, conversation, tokens, last.stats, settings, interrupted,
                  time.perf_counter() - started, baseline)
    report_reply(out, reply, as_json=as_json, verbose=shown.verbose, quiet=quiet, silent=shown.quiet)
    warn_incomplete(out, settings, last.finish_reason)
    if interrupted:
        out.info("interrupted")
        return 130
    return 0


def stream_reply(out: Output, runtime: Runtime, conversation: Any, prompt: str, settings: Any, *, quiet: bool,
                 as_json: bool) -> tuple[Any, list[int], bool] | None:
    """Prints the reply as it streams (not with --json) beside a status line: (the last Step or None, the
    tokens, whether Ctrl-C cut it short); None when stdout was closed."""
    status = None if quiet else out.status_line()
    last, tokens, interrupted = None, [], False
    try:
        steps = conversation.ask(prompt, settings)
        if runtime.first_token_wait:  # a server's queue and prefill can take long: said, not silent
            steps = out.until_first(steps, runtime.first_token_wait)
        out.begin_reply(conversation.reply_in_thinking, conversation.reply_markers)
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
        return None
    except Exception:
        if not as_json:  # the text received so far ends on a fresh line before the error
            out.end_text()
        raise
    finally:
        out.close_status()
    if not as_json:
        out.end_text()
    return last, tokens, interrupted


def warn_incomplete(out: Output, settings: Any, finish_reason: str | None) -> None:
    """A structured reply cut off by the token limit (or the context) is not valid output: said on stderr."""
    if settings.output_format is not None and finish_reason in ("length", "context"):
        limit = "--max-tokens" if finish_reason == "length" else "the context"
        out.warn(f"the output is incomplete: {limit} ran out before {settings.output_format.describe()} was "
                 "complete (raise --max-tokens)")


def _warm_up_both(runtime: Runtime) -> None:
    """--compare's warm-up: a few tokens of both modes, so neither side pays one-time costs."""
    from dflash_cli.engine.generate import warm_up
    from dflash_cli.runtime.local import LocalRuntime

    assert isinstance(runtime, LocalRuntime)  # --compare with --engine is refused before opening
    if not runtime.speculative:
        raise click.UsageError("--compare needs a drafter (--draft FOLDER)")
    warm_up(runtime.target, runtime.drafter, new_tokens=4)


def check_prompt_fits(tokenizer: Any, prompt: str, system: str | None, settings: Any) -> None:
    """With the tokenizer alone, before the weights load: the prompt must leave room under --max-context."""
    from dflash_cli.engine.errors import InvalidSettingError
    from dflash_cli.engine.text import encode_prompt

    n = len(encode_prompt(tokenizer, prompt, chat_template=settings.chat_template, enable_thinking=settings.thinking,
                          system=system))
    if settings.max_context and n >= settings.max_context:
        raise InvalidSettingError(f"the prompt has {n} tokens, --max-context holds {settings.max_context}",
                                  hint="shorten the prompt, or raise --max-context")


def _baseline(runtime: Runtime, conversation: Any, settings: Any) -> tuple[list[int], Any]:
    """--compare's plain decoding of the same prompt: its tokens and statistics."""
    from dflash_cli.engine.generate import generate
    from dflash_cli.runtime.local import LocalRuntime

    assert isinstance(runtime, LocalRuntime)  # --compare with --engine is refused before opening

    # the conversation now ends with the reply: rebuild the prompt that produced it
    messages, conversation.messages = conversation.messages, conversation.messages[:-1]
    try:
        prompt = conversation.prompt_ids(settings)
    finally:
        conversation.messages = messages
    # plain decoding has no blocks: --block-size shapes only the speculative side
    result = generate(runtime.target, None, prompt, **{**settings.engine_kwargs(), "block_size": None})
    return result.tokens, result.stats
