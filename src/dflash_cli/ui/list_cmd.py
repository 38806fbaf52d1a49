"""`dflash-cli list` (and its alias `ls`): the models in the local Hugging Face cache, or the known pairs.

Tables and JSON go to stdout; notes go to stderr.
"""

from __future__ import annotations

import json
import time
from typing import Any

import click

from dflash_cli.models.cache import builtin_folders, builtin_problem, folder_size
from dflash_cli.ui.common import cell, echo, registry, run_plain, table
from dflash_cli.ui.errors import EXIT_OK
from dflash_cli.ui.options import common_options


def _roles(registry: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """lower-case repo id -> (alias, "target" | "drafter"); the first alias naming a repo wins."""
    out: dict[str, tuple[str, str]] = {}
    for alias, entry in registry.items():
        out.setdefault(entry.target.lower(), (alias, "target"))
        if entry.drafter:
            out.setdefault(entry.drafter.lower(), (alias, "drafter"))
    return out


def _ago(ts: float, now: float | None = None) -> str:
    s = max((now or time.time()) - ts, 0)
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if s >= size:
            n = int(s // size)
            return f"{n} {unit}{'s' if n != 1 else ''} ago"
    return "just now"


def local_rows(registry: dict[str, Any]) -> list[dict[str, Any]]:
    from dflash_cli.models import cache

    roles = _roles(registry)
    rows = []
    for repo in cache.list_local():
        alias, role = roles.get(repo.repo_id.lower(), (None, None))
        rows.append({"repo_id": repo.repo_id, "pair": alias, "role": role, "size_bytes": repo.size_on_disk,
                     "revisions": list(repo.revisions), "refs": list(repo.refs),
                     "last_modified": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(repo.last_modified)),
                     "last_modified_ts": repo.last_modified, "path": str(repo.path), "status": repo.status,
                     "problem": repo.problem})
    return rows + builtin_rows()


def builtin_rows() -> list[dict[str, Any]]:
    """The built-in SmolLM2-135M once its first run has converted it (it lives outside the Hub cache)."""
    rows = []
    for dtype, folder in builtin_folders():
        size, modified = folder_size(folder)
        problem = builtin_problem(folder, dtype)
        rows.append({"repo_id": "smollm2-135m" + ("" if dtype == "bfloat16" else f"-{dtype}"), "pair": "demo",
                     "role": "built in", "size_bytes": size, "revisions": [], "refs": [],
                     "last_modified": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(modified)),
                     "last_modified_ts": modified, "path": str(folder),
                     "status": "damaged" if problem else "ok", "problem": problem})
    return rows


def problem_notes(rows: list[dict[str, Any]]) -> list[str]:
    """One line per entry that is not ok: what is wrong and the command that fixes it."""
    notes = []
    for r in rows:
        name, problem = r["repo_id"], r["problem"]
        if r["status"] == "ok":
            continue
        if r["role"] == "built in":
            notes.append(f"{name} is damaged ({problem}): the next run converts it again; "
                         "`dflash-cli rm demo -y` removes it now")
        elif r["status"] == "partial":
            notes.append(f"{name} is only partly downloaded ({problem}): `dflash-cli pull {name}` completes it")
        else:
            notes.append(f"{name} is damaged ({problem}): `dflash-cli rm {name} -y` removes it, then pull it again")
    return notes


def known_rows(registry: dict[str, Any]) -> list[dict[str, Any]]:
    from dflash_cli.models.registry import BUILTIN_MODELS

    rows = [{"alias": alias, "target": e.target, "drafter": e.drafter, "block_size": e.block_size,
             "thinking": e.thinking, "runs": e.runs, "serve_tp": e.serve_tp, "unsupported": e.unsupported,
             "notes": e.notes, "source": e.source}
            for alias, e in sorted(registry.items())]
    rows += [{"alias": name, "target": "(built in)", "drafter": None, "block_size": None, "thinking": None,
              "runs": "local", "serve_tp": None, "unsupported": None, "notes": text, "source": "built-in"}
             for name, text in BUILTIN_MODELS.items()]
    return rows


def runs_cell(row: dict[str, Any]) -> str:
    """Where a pair runs: here (this engine), or on a serving engine (serve-cmd, then --engine URL)."""
    if row["runs"] == "engine":
        return "engine" + (f" (tp {row['serve_tp']})" if row["serve_tp"] else "")
    return "here"


def run_list(out: Any, quiet: bool, as_json: bool, known: bool) -> int:
    from dflash_cli.units import fmt_bytes

    pairs = registry()
    if known:
        rows = known_rows(pairs)
        if as_json:
            echo(json.dumps(rows, indent=2))
        elif quiet:
            echo([r["alias"] for r in rows])
        else:
            echo(table(["NAME", "TARGET", "DRAFTER", "BLOCK", "THINKING", "RUNS", "STATUS"],
                       [[r["alias"], r["target"], cell(r["drafter"]), cell(r["block_size"]), cell(r["thinking"]),
                         runs_cell(r), f"unsupported: {r['unsupported']}" if r["unsupported"] else "ok"]
                        for r in rows]))
            if any(r["runs"] == "engine" for r in rows):
                out.info("RUNS engine: too big for one machine; `dflash-cli serve-cmd NAME --engine vllm|sglang` "
                         "serves it, and --engine URL uses it from here")
        return EXIT_OK
    rows = local_rows(pairs)
    if as_json:
        for r in rows:
            r.pop("last_modified_ts")
        echo(json.dumps(rows, indent=2))
        return EXIT_OK
    if quiet:
        if rows:
            echo([r["repo_id"] for r in rows])
        return EXIT_OK
    if not rows:
        from dflash_cli.models.folders import default_cache_dir

        out.info(f"no models in {default_cache_dir()}; try: dflash-cli pull qwen3-8b "
                 "(dflash-cli list --known shows the known pairs)")
        return EXIT_OK
    now = time.time()
    echo(table(["REPO", "PAIR", "ROLE", "SIZE", "REFS", "REVISION", "MODIFIED", "STATUS"],
                 [[r["repo_id"], cell(r["pair"]), cell(r["role"]), fmt_bytes(r["size_bytes"]),
                   ",".join(r["refs"]) or "-",
                   (r["revisions"][0][:12] if r["revisions"] else "-")
                   + (f" (+{len(r['revisions']) - 1})" if len(r["revisions"]) > 1 else ""),
                   _ago(r["last_modified_ts"], now), r["status"]] for r in rows]))
    for note in problem_notes(rows):
        out.warn(note)
    return EXIT_OK


def list_command(name: str, hidden: bool) -> click.Command:
    @click.command(name=name, hidden=hidden)
    @click.option("-q", "--quiet", is_flag=True, help="Print only repo ids (with --known: names).")
    @click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
    @click.option("--known", is_flag=True, help="List the known pairs (the registry) instead of local models.")
    @common_options
    def command(quiet, as_json, known, color, debug):
        """List the models in the local Hugging Face cache (ls is an alias).

        \b
        Examples:
          dflash-cli list
          dflash-cli ls -q
          dflash-cli list --known
        """
        run_plain(color, debug, lambda out: run_list(out, quiet, as_json, known))

    return command


list_cmd = list_command("list", hidden=False)
ls_cmd = list_command("ls", hidden=True)
