"""What a reply must look like: a JSON Schema, any JSON value, a Lark/GBNF grammar or a regex, read from what
a user or a client wrote, checked, and compiled to one llguidance grammar (engine/constraint.py runs it).

No torch here: the command line checks an option before anything loads.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_cli.engine.errors import InvalidSettingError

KINDS = ("json", "schema", "grammar", "regex")
SETTINGS = ("format", "schema", "grammar", "regex")  # the options (and config keys) that name a format
INSTALL_HINT = "install it with: pip install llguidance"
# the concise schema's types (simonw/llm's spelling) -> JSON Schema's
CONCISE_TYPES = {"str": "string", "string": "string", "int": "integer", "integer": "integer", "float": "number",
                 "number": "number", "bool": "boolean", "boolean": "boolean"}


class OutputFormatError(InvalidSettingError):
    """A schema, grammar or regex that cannot be used; the message says where it is wrong."""


@dataclass(frozen=True)
class OutputFormat:
    """One constraint on a reply. `kind` is one of KINDS; `source` the schema (JSON text), grammar or regex,
    `label` what the user named it by (a file, "json", ...), for messages."""

    kind: str
    source: str
    label: str = ""

    def describe(self) -> str:
        if self.kind == "json":
            return "any JSON value" if self.source == "{}" else "a JSON object"
        return f"{self.kind} {self.label or _short(self.source)}"

    def grammar(self) -> str:
        """The llguidance grammar of this format, checked (OutputFormatError says where it is wrong)."""
        ll = llguidance_module()
        try:
            if self.kind in ("json", "schema"):
                grammar = ll.LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_OPTIONS)
            elif self.kind == "regex":
                grammar = ll.LLMatcher.grammar_from_regex(self.source)
            else:
                grammar = ll.LLMatcher.grammar_from_lark(_to_lark(self.source, self.label))
        except ValueError as e:  # a schema that is not a JSON object
            raise OutputFormatError(f"{self.kind} {self.label}: {first_line(str(e))}".replace("  ", " ")) from None
        is_error, messages = ll.LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error:
            where = f" {self.label}" if self.label else ""
            raise OutputFormatError(f"invalid {self.kind}{where}: {first_line(messages[0])}",
                                    hint=_HINTS[self.kind])
        return grammar


# JSON as models write it, indented or not, but never an unbounded run of whitespace (how constrained small
# models loop forever): between tokens nothing, a space, or one newline and up to 20 spaces or tabs, as
# llama.cpp's JSON-schema grammars allow. A schema's own "x-guidance" options come after these and win.
JSON_OPTIONS = {"whitespace_pattern": r"(?: |\n[ \t]{0,20})?"}
_HINTS = {
    "json": None,
    "schema": "a JSON Schema (an object with \"type\", \"properties\", ...), a file holding one, or the concise "
              "form 'name, age int, bio: a short bio'",
    "grammar": "a Lark grammar (start: ...) or llama.cpp's GBNF (root ::= ...)",
    "regex": "a regular expression in Rust's regex syntax, e.g. '[0-9]{3}-[0-9]{4}'",
}


def json_format(object_only: bool = False) -> OutputFormat:
    """Any JSON value (ollama's `format: json`), or any JSON object (OpenAI's json_object)."""
    return OutputFormat("json", '{"type": "object"}' if object_only else "{}", "json")


def schema_format(schema: dict[str, Any] | str, label: str = "") -> OutputFormat:
    """A JSON Schema given as an object or as JSON text (checked to be an object)."""
    if isinstance(schema, str):
        schema = _json_text(schema, label or "the schema")
    if not isinstance(schema, dict):
        kind = {"list": "array", "str": "string", "int": "number", "float": "number", "bool": "boolean"}.get(
            type(schema).__name__, type(schema).__name__)
        raise OutputFormatError(f"{label or 'the schema'} is a JSON {kind}, not an object",
                                hint=_HINTS["schema"])
    return OutputFormat("schema", json.dumps(schema), label)


def parse_schema_option(value: str) -> OutputFormat:
    """--schema's value: inline JSON, a file of JSON, or llm's concise form ('name, age int, bio: ...')."""
    text = value.strip()
    if not text:
        raise OutputFormatError("--schema is empty", hint=_HINTS["schema"])
    if text.startswith(("{", "[", '"')):
        return schema_format(text, "the schema")
    path = Path(value).expanduser()
    if path.is_file() or text.endswith(".json"):
        return schema_format(_read(path, "schema"), str(path))
    return schema_format(concise_schema(text), "(concise)")


def concise_schema(text: str) -> dict[str, Any]:
    """simonw/llm's concise schema: fields separated by commas (or by newlines when there are any), each
    `name [type][: description]`, the type one of str, int, float, bool (default str); all required, no others."""
    parts = text.splitlines() if "\n" in text.strip() else text.split(",")
    properties: dict[str, Any] = {}
    for part in (p.strip() for p in parts):
        if not part:
            continue
        head, _, description = part.partition(":")
        words = head.split()
        if not 1 <= len(words) <= 2 or not re.fullmatch(r"[A-Za-z_][\w-]*", words[0]):
            raise OutputFormatError(f"--schema: cannot read the field {part!r}", hint=_HINTS["schema"])
        kind = words[1].lower() if len(words) == 2 else "str"
        if kind not in CONCISE_TYPES:
            raise OutputFormatError(f"--schema: unknown type {words[1]!r} for {words[0]!r}",
                                    hint="types: str, int, float, bool")
        properties[words[0]] = {"type": CONCISE_TYPES[kind]}
        if description.strip():
            properties[words[0]]["description"] = description.strip()
    if not properties:
        raise OutputFormatError("--schema names no fields", hint=_HINTS["schema"])
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def grammar_file_format(path_text: str) -> OutputFormat:
    """--grammar's value: a file holding a Lark or GBNF grammar."""
    path = Path(path_text).expanduser()
    return OutputFormat("grammar", _read(path, "grammar"), str(path))


def regex_format(regex: str) -> OutputFormat:
    if not regex:
        raise OutputFormatError("--regex is empty", hint=_HINTS["regex"])
    return OutputFormat("regex", regex, repr(regex))


def parse_format_setting(name: str, value: str) -> OutputFormat | None:
    """One of the four settings by its option name (format, schema, grammar, regex), as the command line, the
    config file and chat's /set give them; `format` takes json (or text: no constraint)."""
    if name == "format":
        if value.strip().lower() in ("text", "none", "off", ""):
            return None
        if value.strip().lower() != "json":
            raise OutputFormatError(f"unknown format {value!r}", hint="--format json (or --schema, --grammar, "
                                                                       "--regex)")
        return json_format()
    if name == "schema":
        return parse_schema_option(value)
    if name == "grammar":
        return grammar_file_format(value)
    if name == "regex":
        return regex_format(value)
    raise ValueError(name)


def request_fields(fmt: OutputFormat) -> dict[str, Any]:
    """The fields of an OpenAI-style chat request that ask a server for `fmt`: `response_format` for JSON
    (OpenAI's own), vLLM's `structured_outputs` for a grammar or regex (this project's `serve` reads both)."""
    if fmt.kind == "json":
        return {"response_format": {"type": "json_object"}}
    if fmt.kind == "schema":
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "reply", "schema": json.loads(fmt.source)}}}
    return {"structured_outputs": {"regex" if fmt.kind == "regex" else "grammar": fmt.source}}


def _to_lark(text: str, label: str) -> str:
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(text)
    except Exception as e:  # the converter raises its own GbnfToLarkError, and plain errors on odd input
        raise OutputFormatError(f"invalid grammar {label}: {first_line(str(e))}", hint=_HINTS["grammar"]) from None


def _json_text(text: str, label: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise OutputFormatError(f"{label} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                                hint=_HINTS["schema"]) from None


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise OutputFormatError(f"{what} file {path} does not exist", hint=_HINTS[what]) from None
    except IsADirectoryError:
        raise OutputFormatError(f"{what} file {path} is a folder", hint=_HINTS[what]) from None
    except UnicodeDecodeError as e:
        raise OutputFormatError(f"{what} file {path} is not UTF-8 text (byte {e.start})",
                                hint=_HINTS[what]) from None
    except OSError as e:
        raise OutputFormatError(f"cannot read {what} file {path}: {e.strerror}", hint=_HINTS[what]) from None


def llguidance_module() -> Any:
    try:
        import llguidance
    except ImportError:
        raise OutputFormatError("structured output needs the llguidance package, which is not installed",
                                hint=INSTALL_HINT) from None
    return llguidance


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "unknown error"


def _short(text: str, width: int = 40) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."
