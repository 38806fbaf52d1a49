"""The prompt sets `bench` runs and `train` can read: built-in ones (math, code, chat) and JSONL files of
{"id": ..., "prompt": ...} lines."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from dflash_cli.engine.errors import DFlashError

BUILTIN_SETS = ("math", "code", "chat")


class PromptSetError(DFlashError):
    """A prompt set cannot be found or read."""


@dataclass(frozen=True)
class Prompt:
    id: str
    prompt: str




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
        prompts.append(Prompt(pid, prompt))
    if not prompts:
        raise PromptSetError(f"{source} holds no prompts")
    return prompts
