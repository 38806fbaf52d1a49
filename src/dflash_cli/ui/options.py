"""The command-line options the commands share, declared once, and what they become: `CommandOptions`
(what to open, how to answer, how to show it) for a generating command's body.

Nothing heavy at import time (`dflash-cli --help` stays fast): the runtime and conversation types load
inside the functions that build them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import click

from dflash_cli import settings as S
from dflash_cli.engine.dtypes import DTYPE_CHOICES, QUANT_CHOICES
from dflash_cli.engine.hf_config import DEVICE_MAP_CHOICES
from dflash_cli.engine.output_format import SETTINGS

if TYPE_CHECKING:  # both import lazily what they need: cheap --help
    from dflash_cli.conversation import GenerationSettings
    from dflash_cli.runtime import ModelOptions

color_option = click.option("--color", type=click.Choice(["auto", "always", "never"]), default=S.DEFAULT_COLOR,
                            envvar=S.ENV["color"], show_envvar=True, show_default=True,
                            help="Colours on terminals.")
debug_option = click.option("--debug", is_flag=True, envvar=S.DEBUG_ENV, help="Show tracebacks of unexpected errors.")
endpoint_option = click.option("--endpoint", envvar="HF_ENDPOINT", hidden=True, default=None,
                               help="Hub endpoint (tests, mirrors).")


def shared_option(*decls: str, **attrs: Any) -> Callable[..., Callable]:
    """An option declared once for every command that takes it; one that needs another default, help or
    environment variable passes just that: `max_tokens_option(default=128)`."""
    return lambda **changes: click.option(*decls, **{**attrs, **changes})


max_tokens_option = shared_option(
    "-n", "--max-tokens", type=click.IntRange(min=1), default=S.DEFAULT_MAX_TOKENS, envvar=S.ENV["max_tokens"],
    show_envvar=True, show_default=True, help="Most tokens to generate.")
block_size_option = shared_option(
    "--block-size", type=click.IntRange(min=1), default=None, envvar=S.ENV["block_size"], show_envvar=True,
    help="Tokens per verify step, 1..the drafter's trained size [default: trained size].")
think_option = shared_option(
    "--think/--no-think", default=None,
    help="Turn the model's thinking mode on or off, where its chat template supports it.")
quiet_option = shared_option("-q", "--quiet", is_flag=True, help="Print only the generated text (and errors).")
device_map_option = shared_option(
    "--device-map", type=click.Choice(DEVICE_MAP_CHOICES), default=S.DEFAULT_DEVICE_MAP, envvar=S.ENV["device_map"],
    show_envvar=True, show_default=True,
    help="Split the target's layers over the GPUs present (accelerate's strategies; auto = balanced), offloading "
         "to cpu, then disk, only as the last resort (slow).")
max_memory_option = shared_option(
    "--max-memory", envvar=S.ENV["max_memory"], show_envvar=True, metavar="DEV=SIZE,..",
    help="Memory each device may use under --device-map, e.g. 0=14GiB,1=14GiB,cpu=30GiB (default: the free "
         "memory of every GPU, then cpu and disk).")


def apply_all(options: list[Callable]) -> Callable:
    """One decorator for a group of click options, listed in --help in the order given."""
    def decorator(f: Callable) -> Callable:
        for option in reversed(options):
            f = option(f)
        return f

    return decorator


model_options = apply_all([
    click.option("-m", "--model", envvar=S.ENV["model"], show_envvar=True, metavar="MODEL",
                 help="Target model: a known name (list --known: qwen3-8b, demo, ...; demo and smollm2-135m are "
                      "built in and offline), a Hub repo id, or a local folder with config.json and *.safetensors."),
    click.option("--draft", envvar=S.ENV["draft"], show_envvar=True, metavar="DRAFTER",
                 help="DFlash drafter for the target: a Hub repo id or a local folder [default: the registry's "
                      "drafter for a known target]. Without one, decoding is plain (speculation off)."),
    click.option("--no-draft", is_flag=True, help="Plain decoding: do not load or use a drafter."),
    click.option("--quant", type=click.Choice([*QUANT_CHOICES, "auto"]),
                 default=S.DEFAULT_QUANT,
                 envvar=S.ENV["quant"], show_envvar=True, show_default="none; auto for the built-in models",
                 help="Quantize the target: q4/q8 with PyTorch's weight-only CPU kernels (bf16 activations), "
                      "q4a8/q8a8 with this project's AVX2 kernels (8-bit activations, as llama.cpp), nf4/int8 with "
                      "bitsandbytes (GPU; nf4 is the recommended one there, int8 is the slow choice: LLM.int8() "
                      "waits on the GPU once or twice in every linear); auto = on a CPU the fastest format "
                      "measured for it (q4 with native bf16, else q4a8; doctor says which), on a GPU the best "
                      "quality that fits in memory."),
    click.option("--max-context", type=click.IntRange(min=16), default=S.DEFAULT_MAX_CONTEXT,
                 envvar=S.ENV["max_context"], show_envvar=True, show_default=True,
                 help="Most tokens (prompt + replies) to hold; sizes the memory check before loading."),
    click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default=S.DEFAULT_DTYPE,
                 envvar=S.ENV["dtype"], show_envvar=True, show_default=True,
                 help="Compute dtype (auto: bf16 on GPUs and bf16-capable CPUs, else fp32)."),
    click.option("--device", default=S.DEFAULT_DEVICE, envvar=S.ENV["device"], show_envvar=True, show_default=True,
                 help="cuda, cuda:N, cpu or auto."),
    device_map_option(),
    max_memory_option(),
    click.option("--threads", type=click.IntRange(min=1), default=None, envvar=S.ENV["threads"], show_envvar=True,
                 help="CPU threads to run on [default: one per core that other processes leave free, re-checked "
                      "every half second while generating; -v shows the count]."),
    click.option("--draft-window", type=click.IntRange(min=0), default=None, envvar=S.ENV["draft_window"],
                 show_envvar=True,
                 help="The drafter attends to the last N tokens of the context only; 0: all of it [default: the "
                      "window the drafter's config names (the demo's: 128), else all]. A drafter trained on short "
                      "prompts drafts better so at thousands of tokens; output is unchanged."),
    click.option("--compile", "compile", type=click.Choice(["auto", "on", "off"]), default=S.DEFAULT_COMPILE,
                 envvar=S.ENV["compile"], show_envvar=True, show_default=True,
                 help="Compile the decode and verify forwards (auto: CUDA graphs on GPUs; not on CPUs, where it "
                      "was measured not to pay). off also turns off the static-cache fast path."),
])


class FiniteFloatRange(click.FloatRange):
    """A FloatRange that also refuses nan and inf (nan passes every comparison, so FloatRange lets it in)."""

    def convert(self, value, param, ctx):
        import math

        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return rv


sampling_options = apply_all([
    max_tokens_option(),
    click.option("--temperature", type=FiniteFloatRange(min=0), default=S.DEFAULT_TEMPERATURE,
                 envvar=S.ENV["temperature"], show_envvar=True, show_default=True,
                 help="0 = greedy (identical to the target alone); > 0 samples, lossless in distribution."),
    click.option("--top-p", type=FiniteFloatRange(min=0, max=1, min_open=True), default=S.DEFAULT_TOP_P,
                 envvar=S.ENV["top_p"], show_envvar=True, show_default=True, help="Nucleus sampling mass."),
    click.option("--top-k", type=click.IntRange(min=0), default=S.DEFAULT_TOP_K, envvar=S.ENV["top_k"],
                 show_envvar=True, show_default=True, help="Sample among the k likeliest tokens (0 = off)."),
    click.option("--seed", type=int, default=None, envvar=S.ENV["seed"], show_envvar=True,
                 help="Seed for reproducible sampling."),
    block_size_option(),
    click.option("-s", "--system", envvar=S.ENV["system"], show_envvar=True, help="System prompt."),
    think_option(),
    click.option("--no-chat-template", is_flag=True, help="Send the prompt as raw text, without the chat template."),
])

def _format_callback(name: str) -> Callable[[click.Context, click.Parameter, str | None], Any]:
    """Reads --format/--schema/--grammar/--regex (from the flag, the variable or the config file) into an
    OutputFormat, checked now: a bad schema, grammar or regex is a usage error before anything loads."""
    def convert(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
        if value is None:
            return None
        from dflash_cli.engine.output_format import OutputFormatError, parse_format_setting

        try:
            fmt = parse_format_setting(name, value)
            if fmt is not None:
                fmt.grammar()
            return fmt
        except OutputFormatError as e:
            raise click.BadParameter(str(e) + (f" ({e.hint})" if e.hint else ""), ctx, param) from None

    return convert


FORMAT_KEYS = SETTINGS
format_options = apply_all([
    click.option("--format", "format", envvar=S.ENV["format"], show_envvar=True, metavar="json|text",
                 callback=_format_callback("format"),
                 help="json: the reply is one JSON value and nothing else (ollama's format); text: no constraint."),
    click.option("--schema", envvar=S.ENV["schema"], show_envvar=True, metavar="SCHEMA",
                 callback=_format_callback("schema"),
                 help="The reply is JSON following SCHEMA: a JSON Schema inline or in a file, or the concise "
                      "form 'name, age int, bio: a short bio' (types str, int, float, bool)."),
    click.option("--grammar", envvar=S.ENV["grammar"], show_envvar=True, metavar="FILE",
                 callback=_format_callback("grammar"),
                 help="The reply follows the grammar in FILE: Lark (start: ...) or llama.cpp's GBNF (root ::= ...)."),
    click.option("--regex", envvar=S.ENV["regex"], show_envvar=True, metavar="RE", callback=_format_callback("regex"),
                 help="The reply matches the regular expression RE (Rust regex syntax)."),
])

output_options = apply_all([
    color_option,
    click.option("--provenance/--no-provenance", default=True, show_default=True,
                 help="Colour drafted-and-accepted tokens apart from the target's own (terminals only)."),
    click.option("--hide-thinking/--show-thinking", default=False, envvar=S.ENV["hide_thinking"],
                 show_envvar=True,
                 help="Leave a thinking model's reasoning out of the printed reply (shown dimmed on terminals "
                      "by default); --json keeps it under 'thinking' either way."),
    click.option("-v", "--verbose", is_flag=True, help="Print detailed statistics on stderr."),
    quiet_option(),
    debug_option,
])


engine_option = apply_all([
    click.option("--engine", envvar=S.ENV["engine"], show_envvar=True, metavar="URL",
                 help="Send the prompt to an OpenAI-compatible server (vLLM or SGLang serving a DFlash drafter) "
                      "instead of loading a model here; -m names the served model (default: its only one). "
                      "Key: $DFLASH_API_KEY."),
    click.option("--timeout", type=FiniteFloatRange(min=0, min_open=True), default=None, envvar=S.ENV["timeout"],
                 show_envvar=True, metavar="SECONDS",
                 help="With --engine: seconds to wait for the server (its model list, each part of a reply, the "
                      "first token included) [default: 600 for a reply, 30 for the model list]."),
])


common_options = apply_all([color_option, debug_option])


@dataclass(frozen=True)
class OutputOptions:
    """How a reply is shown (output_options)."""

    color: str = S.DEFAULT_COLOR
    provenance: bool = True
    hide_thinking: bool = False
    verbose: bool = False
    quiet: bool = False
    debug: bool = False


@dataclass(frozen=True)
class CommandOptions:
    """A generating command's options, read once from the command line, the environment and the config
    file (click merges them): what to open, how to answer, how to show it. The raw values stay in the
    command's function; its body gets this."""

    model: ModelOptions
    settings: GenerationSettings  # per reply (chat changes them with /set)
    system: str | None = None  # as given: not yet checked for UTF-8 (prompt_input.system_prompt)
    output: OutputOptions = OutputOptions()


def command_options(values: dict[str, Any]) -> CommandOptions:
    """The options of a command built from model_options, engine_option, sampling_options, output_options
    (those it has; the rest keep their defaults)."""
    return CommandOptions(model_options_of(values), generation_settings(values), values.get("system"),
                          OutputOptions(**_present(values, OutputOptions)))


def model_options_of(values: dict[str, Any]):
    """runtime.ModelOptions of model_options and engine_option's values."""
    from dflash_cli.runtime import ModelOptions

    return ModelOptions(**_present(values, ModelOptions))


def generation_settings(values: dict[str, Any]):
    """The per-reply settings of sampling_options' values (and --max-context)."""
    from dflash_cli.conversation import GenerationSettings

    return GenerationSettings(**_present(values, GenerationSettings), output_format=output_format_of(values),
                              chat_template=not values.get("no_chat_template", False))


def output_format_of(values: dict[str, Any]) -> Any:
    """The one OutputFormat of --format/--schema/--grammar/--regex, or None. A flag overrides the environment,
    which overrides the config file (`--format text` turns a configured format off); two at the same level
    are a usage error."""
    from click.core import ParameterSource

    ctx = click.get_current_context(silent=True)
    for level in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT, ParameterSource.DEFAULT_MAP):
        keys = [key for key in FORMAT_KEYS if ctx is not None and key in values
                and ctx.get_parameter_source(key) == level]
        if len(keys) > 1:
            from dflash_cli.ui.common import setting_source

            assert ctx is not None

            names = [setting_source(ctx, key)[1] for key in keys]
            raise click.UsageError(f"{names[0]} and {names[1]} cannot be combined: a reply follows one format")
        if keys:
            return values[keys[0]]
    given = [values[key] for key in FORMAT_KEYS if values.get(key) is not None]  # no click context: a caller's
    if len(given) > 1:
        raise click.UsageError("give one of --format, --schema, --grammar, --regex")
    return given[0] if given else None


def _present(values: dict[str, Any], cls: Any) -> dict[str, Any]:
    return {f.name: values[f.name] for f in fields(cls) if f.name in values}
