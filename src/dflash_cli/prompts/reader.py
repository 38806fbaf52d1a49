"""The prompt sets `bench` runs and `train` can read: built-in ones (math, code, chat, json) and JSONL files
of {"id": ..., "prompt": ...} lines, where a line may also name the reply's format ("schema", "format",
"grammar" or "regex", as the command-line options)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from dflash_cli.engine.errors import DFlashError
from dflash_cli.engine.output_format import SETTINGS as FORMAT_KEYS  # a prompt's reply format, as the options

BUILTIN_SETS = ("math", "code", "chat", "json")
DEFAULT_SETS = ("math", "code", "chat")  # what `bench` runs without --sets (json: structured replies, on request)


class PromptSetError(DFlashError):
    """A prompt set cannot be found or read."""


@dataclass(frozen=True)
class Prompt:
    id: str
    prompt: str
    output: tuple[str, str] | None = None  # (one of FORMAT_KEYS, its value): the reply's format, if any




def load_prompt_set(name_or_path: str | Path) -> list[Prompt]:
    """A built-in set (math, code, chat) or a JSONL file of {"id": ..., "prompt": ...} lines.

    Blank lines are skipped; a missing "id" becomes "<file stem>-<line number>". Raises PromptSetError
    (one line, naming the file and line number) for a missing file, bad JSON, a missing or empty prompt,
    or a repeated id.
    """
    name = str(name_or_path)
    if name in BUILTIN_SETS and not isinstance(name_or_path, Path):
        text = resources.files("dflash_cli.prompts").joinpath(f"{name}.jsonl").read_text(encoding="utf-8")
        return parse_jsonl(text, f"{name}.jsonl", name)
    path = Path(name).expanduser()
    if not path.is_file():
        if path.exists():
            raise PromptSetError(f"prompt file {name} is not a file")
        if "/" not in name and not name.endswith(".jsonl"):
            raise PromptSetError(f"unknown prompt set {name!r}: use {', '.join(BUILTIN_SETS)} or a .jsonl file")
        raise PromptSetError(f"prompt file {name} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PromptSetError(f"cannot read prompt file {name}: {e}") from None
    return parse_jsonl(text, name, path.stem)


def _output(item: dict, where: str) -> tuple[str, str] | None:
    """A prompt's "format" / "schema" (an object or llm's concise form) / "grammar" / "regex", checked."""
    from dflash_cli.engine.output_format import OutputFormatError, parse_format_setting

    given = [key for key in FORMAT_KEYS if item.get(key) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise PromptSetError(f"{where}: give one of {', '.join(FORMAT_KEYS)}, not {' and '.join(given)}")
    key, value = given[0], item[given[0]]
    value = json.dumps(value) if key == "schema" and isinstance(value, dict) else value
    if not isinstance(value, str):
        raise PromptSetError(f'{where}: "{key}" must be a string' + (" or an object" if key == "schema" else ""))
    try:
        fmt = parse_format_setting(key, value)
        if fmt is not None:
            fmt.grammar()
    except OutputFormatError as e:
        raise PromptSetError(f"{where}: {e}") from None
    return key, value


def parse_jsonl(text: str, source: str, stem: str) -> list[Prompt]:
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{source} line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptSetError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(item, dict):
            raise PromptSetError(f'{where}: expected an object like {{"id": ..., "prompt": ...}}')
        prompt = item.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise PromptSetError(f'{where}: "prompt" must be a non-empty string')
        pid = item.get("id", f"{stem}-{number}")
        if not isinstance(pid, (str, int)) or isinstance(pid, bool):
            raise PromptSetError(f'{where}: "id" must be a string or a number')
        pid = str(pid)
        if pid in seen:
            raise PromptSetError(f"{where}: id {pid!r} appears twice")
        seen.add(pid)
        prompts.append(Prompt(pid, prompt, _output(item, where)))
    if not prompts:
        raise PromptSetError(f"{source} holds no prompts")
    return prompts
