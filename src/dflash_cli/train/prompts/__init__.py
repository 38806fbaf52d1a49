"""The training prompt sets, and the `train --prompts SPEC` that picks them.

A spec part is a file (one prompt per line, or JSONL with "prompt"), a built-in set generated from templates
(`demo`, `mix`, `wide`, or `NAME:N` for N of its prompts: demo.py, mix.py, wide.py, with what they share in
draw.py), or `self:N`, prompts the target writes (self_written.py, checked by quality.py); no spec is the
small built-in set of default.py. The bench prompt sets (dflash_cli/prompts/*.jsonl) are written separately
and never generated here; a test checks that the two stay apart.

Specs join with `+` (`mix:24000+wide:8000`, `resolve_prompt_parts`): one list, the parts in order, so a
folder's stored answers keep their index when a later run lists another set after them (answers are found by
their place in the list). `self:N` is not a template set: the target writes those prompts, so only `train`,
with the target loaded, resolves it (`resolve_prompt_parts(spec, self_part)`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from dflash_cli.train.prompts.demo import demo_prompts_with_categories
from dflash_cli.train.prompts.mix import mix_prompts_with_categories
from dflash_cli.train.prompts.wide import wide_prompts_with_categories

T = TypeVar("T")

CATEGORIZED_SETS = {"demo": demo_prompts_with_categories, "mix": mix_prompts_with_categories,
                    "wide": wide_prompts_with_categories}


# `self:N` parts are written by the target (self_written.py): the caller that has it loaded samples them
SELF = "self"
SELF_DEFAULT = 4000
SELF_LIMIT = 100_000  # prompts the target writes itself, one sampled turn each
PART_LIMIT = 1_000_000  # prompts drawn from a built-in set's templates (each one answered by the target)
SelfPart = Callable[[int], tuple[list[str], list[str]]]


def resolve_prompt_parts(spec: str | None, self_part: SelfPart | None = None
                         ) -> list[tuple[list[str], list[str] | None]]:
    """The parts of a `train --prompts` spec, each as (prompts, their categories or None): `A+B` joins several
    files and sets into one list, in order, so a folder's stored answers keep their place when a later run adds a
    set after them (`mix:24000+wide:8000`). A file whose own name has a `+` is read as that file. A `self:N`
    part (at most one) is `self_part(N)`: prompts the target writes, which only `train` can sample."""
    return _each_part(spec, lambda part: _resolve_one(part, self_part))


def check_prompt_spec(spec: str | None) -> None:
    """Raises what `resolve_prompt_parts` would for `spec`, before any target is loaded, without drawing the
    built-in sets or sampling self parts (files are read)."""
    def check(part: str | None) -> None:
        if _categorized(part) is None and _self_count(part) is None:
            _resolve_uncategorized(part)

    _each_part(spec, check)


def _each_part(spec: str | None, resolve: Callable[[str | None], T]) -> list[T]:
    from pathlib import Path

    from dflash_cli.engine.errors import InvalidSettingError

    if spec is None or Path(spec).is_file() or "+" not in spec:
        return [resolve(spec)]
    parts = [part.strip() for part in spec.split("+")]
    if not all(parts):
        raise InvalidSettingError(f"an empty part in the prompt spec {spec!r}", hint="join sets and files as A+B")
    if sum(_self_count(part) is not None for part in parts) > 1:
        raise InvalidSettingError(f"more than one self part in {spec!r}", hint="ask for them together: self:N")
    try:
        return [resolve(part) for part in parts]
    except InvalidSettingError as e:
        raise InvalidSettingError(f"{e} (in {spec!r})", hint=e.hint) from None


def _self_count(part: str | None) -> int | None:
    """N of a `self` / `self:N` part (not a file of that name), else None."""
    named = _name_and_count(part)
    if named is None or named[0] != SELF:
        return None
    return named[1] or SELF_DEFAULT


def _categorized(part: str | None) -> tuple[str, int | None] | None:
    """(set name, count or None for its default) of a `demo`/`mix`/`wide` part (not a file), else None."""
    named = _name_and_count(part)
    return named if named is not None and named[0] in CATEGORIZED_SETS else None


def _name_and_count(part: str | None) -> tuple[str, int | None] | None:
    """(NAME, N or None) of a `NAME` / `NAME:N` part with N > 0 that is not a file, else None. A built-in
    set's `NAME:` without a number, or with more prompts than a run can use, is refused here: before the
    target loads, not after minutes of drawing prompts (or the memory running out)."""
    from pathlib import Path

    from dflash_cli.engine.errors import InvalidSettingError

    if part is None or Path(part).is_file():
        return None
    name, colon, count = part.partition(":")
    known = name in CATEGORIZED_SETS or name == SELF
    if known and colon and not count:
        raise InvalidSettingError(f"{part!r} has no count", hint=f"{name}:N for N prompts, or {name} alone for "
                                                                  "its default size")
    if count and not (count.isdecimal() and int(count) > 0):
        return None
    limit = SELF_LIMIT if name == SELF else PART_LIMIT
    if known and count and int(count) > limit:
        raise InvalidSettingError(f"{part!r} asks for more prompts than a run can use (at most {limit} in a "
                                  f"{name} part)", hint="a run answers every prompt: a few thousand to tens of "
                                                        "thousands is what a drafter trains on")
    return name, int(count) if count else None


def _resolve_one(spec: str | None, self_part: SelfPart | None = None) -> tuple[list[str], list[str] | None]:
    from dflash_cli.engine.errors import InvalidSettingError

    if (categorized := _categorized(spec)) is not None:
        name, count = categorized
        pairs = CATEGORIZED_SETS[name](count) if count else CATEGORIZED_SETS[name]()
        return [p for _, p in pairs], [cat for cat, _ in pairs]
    if (wanted := _self_count(spec)) is not None:
        if self_part is None:
            raise InvalidSettingError(f"{spec} prompts are written by the target, and only train samples them",
                                      hint="use train --prompts self:N")
        return self_part(wanted)
    return _resolve_uncategorized(spec), None


def resolve_prompts_with_categories(spec: str | None) -> tuple[list[str], list[str] | None]:
    """`resolve_prompts(spec)` and each prompt's category (math, code or chat) when every part is a built-in
    `demo`, `mix` or `wide` set; None for prompt files and the small built-in set."""
    return join_prompt_parts(resolve_prompt_parts(spec))


def join_prompt_parts(parts: list[tuple[list[str], list[str] | None]]) -> tuple[list[str], list[str] | None]:
    """One (prompts, categories) list from `resolve_prompt_parts`; categories only when every part has them."""
    texts = [t for part, _ in parts for t in part]
    categories: list[str] = []
    for _, cats in parts:
        if cats is None:
            return texts, None
        categories.extend(cats)
    return texts, categories


def resolve_prompts(spec: str | None) -> list[str]:
    """Prompts for `train --prompts SPEC`: a file (one per line, or JSONL with "prompt"), a built-in set
    (`demo` = 6000 prompts, `demo:N` = N of them; `mix` = 12000 prompts at a steady 40/30/30% math/code/chat,
    `mix:N` = N of them; `wide`/`wide:N` the same for longer, freer requests), several joined by `+`, or
    None for the small built-in set. A `self:N` part is an error here: only `train` samples it."""
    return resolve_prompts_with_categories(spec)[0]


def _resolve_uncategorized(spec: str | None) -> list[str]:
    from pathlib import Path

    from dflash_cli.engine.errors import InvalidSettingError
    from dflash_cli.train.data import read_prompts

    if spec is None:
        from dflash_cli.train.prompts.default import DEFAULT_PROMPTS

        return list(DEFAULT_PROMPTS)
    if Path(spec).is_file():
        return read_prompts(spec)
    raise InvalidSettingError(f"no prompt file or built-in prompt set named {spec!r}",
                              hint=f"give a file (one prompt per line, or JSONL with a \"prompt\" field) or "
                                   f"one of: {', '.join([*CATEGORIZED_SETS, SELF])}, or NAME:COUNT such as "
                                   "mix:30000; "
                                   "join several with + (a file whose name has a + only alone)")
