"""The Python API (re-exported by `dflash_cli`): load a model pair once, then generate from text or ids.

`load` is what the CLI does before a reply (resolve the names, check the pair, load, pick the forward);
`stream_generate` and `generate` take a prompt as text (chat-templated with the runtime's tokenizer) or as
token ids, and pass the other keywords to the engine (`engine.generate.stream_generate`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from dflash_cli import settings as S
from dflash_cli.engine.response import GenerationResult, Step
from dflash_cli.runtime import ModelOptions, open_local
from dflash_cli.runtime.local import LocalRuntime


def load(model: str, draft: str | None = None, *, no_draft: bool = False, quant: str | None = None,
         dtype: str | None = None, device: str | None = None, compile: str = S.DEFAULT_COMPILE,
         max_context: int | None = None, device_map: str | None = None,
         max_memory: str | dict[str, int] | None = None, threads: int | None = None,
         draft_window: int | None = None) -> LocalRuntime:
    """A target (a folder, a known name such as "qwen3-8b", a Hub repo id, or the built-in "demo"), its drafter
    (the registry's for a known target, `draft`, or none with `no_draft`) and its tokenizer, as the command
    line opens them: the pair and its memory are checked from config files before any download.

    quant: None (auto for the built-in models, else none), "auto", "q4"/"q8" (weight-only, CPU), "q4a8"/"q8a8"
    (8-bit activations, AVX2 CPUs) or
    "int8"/"nf4" (bitsandbytes, CUDA); dtype: "float32", "bfloat16" or "float16" (default: auto);
    device: "cpu", "cuda", ... (default: the best available); compile: "auto", "on" or "off";
    max_context: positions of the static cache (default: the model's, at most settings.DEFAULT_MAX_CONTEXT);
    device_map: None (one device), "auto", "balanced" or "sequential" splits the target's layers over the
    GPUs (cpu/disk offload last); max_memory: "0=14GiB,1=14GiB,cpu=30GiB" or {"cuda:0": bytes, ...};
    threads: CPU threads (default: one per core other processes leave free, re-checked while generating).
    draft_window: the drafter attends to the last N context positions only (0: all; default: the window its
        config names, else all; output unchanged).
    """
    return open_local(ModelOptions(model=model, draft=draft, no_draft=no_draft, quant=quant,
                                   dtype=dtype or S.DEFAULT_DTYPE, device=device or S.DEFAULT_DEVICE,
                                   compile=compile, max_context=max_context, device_map=device_map,
                                   max_memory=max_memory, threads=threads,
                                   draft_window=draft_window))


def prompt_ids(runtime: LocalRuntime, prompt: str | Sequence[int], *, chat_template: bool = True,
               think: bool | None = None, system: str | None = None) -> list[int]:
    """Token ids of `prompt`: text goes through the target's chat template (think: None = the template's
    default); ids are taken as they are."""
    if not isinstance(prompt, str):
        return [int(t) for t in prompt]
    from dflash_cli.engine.text import encode_prompt

    return encode_prompt(runtime.tokenizer, prompt, chat_template=chat_template, enable_thinking=think, system=system)


def stream_generate(runtime: LocalRuntime, prompt: str | Sequence[int], *, chat_template: bool = True,
                    think: bool | None = None, system: str | None = None, schema: dict | str | None = None,
                    format: str | None = None, grammar: str | None = None, regex: str | None = None,
                    **kwargs: Any) -> Iterator[Step]:
    """Yields one `Step` per target forward; the last one's `stats` are the final statistics.

    schema (a JSON Schema, or llm's concise 'name, age int'), format ("json"), grammar (Lark or GBNF text) or
    regex: the reply follows it (thinking then defaults to off). kwargs: max_new_tokens, temperature, top_p,
    top_k, seed, block_size, stop_ids, max_context, adaptive, state (see
    `dflash_cli.engine.generate.stream_generate`).
    """
    from dflash_cli.engine.generate import stream_generate as engine_stream

    fmt = _output_format(schema, format, grammar, regex)
    think = False if fmt is not None and think is None else think
    ids = prompt_ids(runtime, prompt, chat_template=chat_template, think=think, system=system)
    return engine_stream(runtime.target, runtime.drafter, ids, tokenizer=runtime.tokenizer, output_format=fmt,
                         **kwargs)


def generate(runtime: LocalRuntime, prompt: str | Sequence[int], **kwargs: Any) -> GenerationResult:
    """Runs `stream_generate` (same arguments) to the end: the generated token ids, their text and the final
    statistics."""
    tokens: list[int] = []
    text: list[str] = []
    last = None
    for last in stream_generate(runtime, prompt, **kwargs):
        tokens.extend(last.tokens)
        text.append(last.text)
    assert last is not None
    return GenerationResult(tokens, "".join(text), last.stats)


def _output_format(schema: dict | str | None, format: str | None, grammar: str | None, regex: str | None) -> Any:
    from dflash_cli.engine.errors import InvalidSettingError
    from dflash_cli.engine.output_format import OutputFormat, parse_format_setting, regex_format, schema_format

    given = {k: v for k, v in dict(schema=schema, format=format, grammar=grammar, regex=regex).items() if v is not None}
    if len(given) > 1:
        raise InvalidSettingError(f"give one of schema, format, grammar, regex, not {' and '.join(given)}")
    fmt = None
    if isinstance(schema, dict):
        fmt = schema_format(schema)
    elif schema is not None:
        fmt = parse_format_setting("schema", schema)
    elif format is not None:
        fmt = parse_format_setting("format", format)
    elif grammar is not None:
        fmt = OutputFormat("grammar", grammar, "(grammar)")
    elif regex is not None:
        fmt = regex_format(regex)
    if fmt is not None:
        fmt.grammar()  # checked now: one error naming what is wrong
    return fmt
