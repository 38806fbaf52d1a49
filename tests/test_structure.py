"""The shape of the package: no import cycles, no private names imported across modules, floors that
import downwards only (ui/ may use models/ and engine/, never the reverse); test modules share through
tests/support/, never by importing each other."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
# Private names still imported across modules (none left; a new one fails the test).
KNOWN_PRIVATE: set[tuple[str, str]] = set()


def modules() -> dict[str, ast.Module]:
    out = {}
    for path in SRC.rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        out[name] = ast.parse(path.read_text(encoding="utf-8"))
    return out


def imports(tree: ast.Module) -> list[tuple[str, str]]:
    """(module, name) for every `from dflash_cli... import name`, lazy imports inside functions included."""
    return [(node.module, alias.name) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dflash_cli")
            for alias in node.names]


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: {f"{m}.{n}" if f"{m}.{n}" in mods else m for m, n in imports(tree)} & set(mods) - {name}
            for name, tree in mods.items()}


def test_no_import_cycles():
    edges, state, cycles = graph(), {}, []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for start in sorted(edges):
        if start not in state:
            visit(start, [start])
    assert cycles == []


def test_no_private_names_imported_across_modules():
    found = {(name, f"{m}.{n}") for name, tree in modules().items() for m, n in imports(tree)
             if n.startswith("_") and not n.startswith("__")}
    assert found - KNOWN_PRIVATE == set()


def test_no_late_imports_in_the_command_layer():
    noqa = [p.name for p in (SRC / "dflash_cli").rglob("*.py") if "noqa: E402" in p.read_text(encoding="utf-8")]
    assert noqa == []


# The floors, ground first: a module may import its own package and the floors below it, nothing beside or
# above it. Each entry is a top-level module or package of dflash_cli ("dflash_cli" is the package's
# __init__); a new one has to be given a floor here.
FLOORS: list[tuple[str, ...]] = [
    ("settings", "sysinfo", "units", "tables"),  # plain helpers, no torch
    ("engine",),  # models, decoding loop, statistics
    ("models", "conversation", "prompts"),  # checkpoints and names; chat history; the bench prompt sets
    ("runtime", "train"),  # a loaded pair, local or remote; drafter training
    ("server", "bench", "api"),  # `serve`'s worker and app; `bench`; the Python API
    ("dflash_cli",),
    ("ui",),  # the terminal: commands, chat, rendering
    ("__main__",),
]


def floor_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_every_part_of_the_package_has_a_floor():
    placed = {part for floor in FLOORS for part in floor}
    assert {floor_of(name) for name in graph()} - placed == set()


def test_every_floor_imports_only_downwards():
    level = {part: i for i, floor in enumerate(FLOORS) for part in floor}
    offenders = {(name, target) for name, targets in graph().items() for target in targets
                 if floor_of(name) != floor_of(target) and level[floor_of(target)] >= level[floor_of(name)]}
    assert offenders == set()


def test_both_runtimes_are_runtimes_without_stand_in_attributes():
    """Commands use only what the Runtime protocol names; the remote one implements it for real, with no class
    attributes set to placeholder values to look like a loaded pair (tokenizer = None, dtype = "remote")."""
    import dataclasses

    from typing_extensions import get_protocol_members

    from dflash_cli.runtime import Runtime
    from dflash_cli.runtime.local import LocalRuntime
    from dflash_cli.runtime.remote import RemoteRuntime

    members = get_protocol_members(Runtime)
    assert {"speculative", "conversation", "info", "check_block_size", "thinking_mode", "load_seconds"} <= members
    for cls in (LocalRuntime, RemoteRuntime):
        data = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {"load_seconds"}
        missing = {name for name in members if name not in data and not callable(getattr(cls, name, None))
                   and not isinstance(getattr(cls, name, None), property)}
        assert missing == set(), (cls.__name__, missing)
    stand_ins = {name for name, value in vars(RemoteRuntime).items()
                 if not name.startswith("__") and not callable(value) and not isinstance(value, property)}
    assert stand_ins == set()
    init = ast.parse(inspect.getsource(RemoteRuntime.__init__).strip().replace("def __init__", "def f", 1))
    assigned = {t.attr for node in ast.walk(init) if isinstance(node, ast.Assign) for t in node.targets
                if isinstance(t, ast.Attribute)}
    assert "load_seconds" in assigned and not {"tokenizer", "dtype", "device", "target_dir"} & assigned


def test_commands_get_options_not_click_dictionaries():
    """The raw click values stay in each command's function: no body takes an `opts` dictionary, and every
    ModelOptions field is an option of the commands that open a model (a renamed option would otherwise
    fall silently back to its default)."""
    import dataclasses

    from dflash_cli.runtime import ModelOptions
    from dflash_cli.ui.cli import cli

    offenders = set()
    for name, tree in modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(a.arg == "opts" for a in node.args.args):
                offenders.add(f"{name}.{node.name}")
    assert offenders == set()
    fields = {f.name for f in dataclasses.fields(ModelOptions)}
    for command in ("generate", "chat", "bench", "serve"):
        params = {p.name for p in cli.commands[command].params}
        local_only = {"engine", "timeout"} if command == "serve" else set()
        assert fields - local_only <= params, (command, fields - local_only - params)


def imported_module_names(tree: ast.Module) -> set[str]:
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    return names | {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}


def test_test_modules_share_through_support_not_each_other():
    tests = Path(__file__).resolve().parent
    borrowed = {(path.name, module) for path in tests.rglob("*.py")
                for module in imported_module_names(ast.parse(path.read_text(encoding="utf-8")))
                if module.split(".")[0].startswith("test_")}
    assert borrowed == set()
