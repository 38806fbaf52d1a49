"""`pull`, `list`/`ls`, `show` and `rm`: the terminal layer over models/ (hub, registry, plan).

No tensor code here, and nothing heavy at import time (`dflash-cli --help` stays fast): huggingface_hub,
rich and torch are imported inside the functions that need them. Tables and JSON go to stdout; progress,
status lines, prompts and errors go to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from dflash_cli import settings as S
from dflash_cli.engine.errors import CheckpointError, DFlashError
from dflash_cli.ui.errors import EXIT_OK, EXIT_USAGE

DEFAULT_CONTEXT = 8192
DEFAULT_SHOW_QUANT = "bf16"


# ----------------------------------------------------------------------------------------------- helpers
def _registry() -> dict[str, Any]:
    from dflash_cli.models.registry import load_registry

    try:
        config = S.load_config()
    except S.ConfigError as error:
        raise DFlashError(str(error), error.hint) from None
    return load_registry(config.pairs, user_source=str(config.path))


def _config_values() -> dict[str, Any]:
    try:
        return dict(S.load_config().values)
    except S.ConfigError:
        return {}


def _known_names(registry: dict[str, Any]) -> str:
    from dflash_cli.models.registry import BUILTIN_MODELS

    return ", ".join(sorted(registry)) + ", " + ", ".join(BUILTIN_MODELS)


def _unknown(spec: str, registry: dict[str, Any]) -> CheckpointError:
    return CheckpointError(f"model {spec!r} is not a known name or a Hub repo id (org/name)",
                           hint=f"known names: {_known_names(registry)} (dflash-cli list --known)")


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


def table(headers: list[str], rows: list[list[str]]) -> list[str]:
    """Left-aligned columns separated by three spaces (ollama's look); no trailing blanks."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    return ["   ".join(f"{str(c):<{w}}" for c, w in zip(r, widths)).rstrip() for r in [headers, *rows]]


def _print(lines: list[str] | str) -> None:
    click.echo("\n".join(lines) if isinstance(lines, list) else lines)


def common_options(f: Callable) -> Callable:
    f = click.option("--debug", is_flag=True, envvar=S.DEBUG_ENV, help="Show tracebacks of unexpected errors.")(f)
    f = click.option("--color", type=click.Choice(["auto", "always", "never"]), default=S.DEFAULT_COLOR,
                     envvar=S.ENV["color"], show_envvar=True, show_default=True, help="Colours on terminals.")(f)
    return f


def endpoint_option(f: Callable) -> Callable:
    return click.option("--endpoint", envvar="HF_ENDPOINT", hidden=True, default=None,
                        help="Hub endpoint (tests, mirrors).")(f)


def _run(color: str, debug: bool, body: Callable) -> None:
    from dflash_cli.ui.cli import guarded
    from dflash_cli.ui.render import Output

    guarded(lambda: Output(color, provenance=False), body, debug)


# ----------------------------------------------------------------------------------------------- progress
def progress_enabled(stream: Any) -> bool:
    """Bars only on a terminal, and never with HF_HUB_DISABLE_PROGRESS_BARS set."""
    from dflash_cli.ui.render import _isatty

    flag = os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").strip().upper()
    return _isatty(stream) and flag not in {"1", "ON", "YES", "TRUE"}


def make_tqdm_class(progress: Any, label: str) -> type:
    """A tqdm subclass for `snapshot_download(tqdm_class=)` that forwards to a rich Progress (or to nothing).

    huggingface_hub opens three bars: transfer bytes, "reconstructed" (written) bytes, and a file count.
    The written-bytes bar (exact total) and the file count are shown; the transfer bar is dropped.
    """
    import io

    from tqdm.std import tqdm as std_tqdm

    class RichTqdm(std_tqdm):
        _task = None  # tqdm's __init__ refreshes before the rich task exists

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("name", None)
            kwargs["file"] = io.StringIO()  # tqdm itself draws nothing anywhere
            kwargs["disable"] = False
            desc = str(kwargs.get("desc") or "")
            super().__init__(*args, **kwargs)
            if progress is None or desc.startswith("Downloading bytes"):
                return
            if "files" in desc:
                self._kind, text = "files", f"{label} files"
            else:
                self._kind, text = "bytes", label
            self._task = progress.add_task(text, total=self.total or None, kind=self._kind)

        def display(self, msg: str | None = None, pos: int | None = None) -> bool:  # noqa: ARG002
            return True

        def _push(self) -> None:
            if self._task is not None:
                progress.update(self._task, completed=self.n, total=self.total or None)

        def update(self, n: float | None = 1) -> bool | None:
            result = super().update(n)
            self._push()
            return result

        def refresh(self, *args: Any, **kwargs: Any) -> None:
            self._push()

        def close(self) -> None:
            self._push()
            super().close()

    return RichTqdm


def _rich_progress(stream: Any):
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, ProgressColumn,
                               TextColumn, TimeRemainingColumn, TransferSpeedColumn)
    from rich.text import Text

    class ByKind(ProgressColumn):
        """Bytes columns for byte bars, "3/7" for the file count."""

        def __init__(self, for_bytes: ProgressColumn, for_files: ProgressColumn | None) -> None:
            super().__init__()
            self.for_bytes, self.for_files = for_bytes, for_files

        def render(self, task):  # noqa: ANN001
            if task.fields.get("kind") == "files":
                return self.for_files.render(task) if self.for_files else Text("")
            return self.for_bytes.render(task)

    return Progress(TextColumn("{task.description}"), BarColumn(),
                    ByKind(DownloadColumn(), MofNCompleteColumn()), ByKind(TransferSpeedColumn(), None),
                    ByKind(TimeRemainingColumn(), None),
                    console=Console(file=stream), transient=True)


# ----------------------------------------------------------------------------------------------- pull
@dataclass(frozen=True)
class Wanted:
    repo_id: str
    revision: str | None
    role: str  # "target" or "drafter"


def pull_targets(spec: str, revision: str | None, no_draft: bool) -> tuple[list[Wanted], str | None]:
    """The repos `pull MODEL` fetches, and the pair alias (if any)."""
    from dflash_cli.models.registry import ModelSpec, resolve_spec

    registry = _registry()
    try:
        ms: ModelSpec = resolve_spec(spec, registry)
    except CheckpointError:
        raise _unknown(spec, registry) from None
    if ms.kind == "folder":
        raise CheckpointError(f"{spec} is a local folder: there is nothing to pull",
                              hint="use it directly: dflash-cli chat -m " + spec)
    if ms.kind == "builtin":
        raise CheckpointError(f"{spec} is built in (converted locally on first use): there is nothing to pull",
                              hint=f"run it directly: dflash-cli chat -m {spec}")
    out = [Wanted(ms.target, revision or ms.target_revision, "target")]
    if ms.drafter and not no_draft:
        out.append(Wanted(ms.drafter, ms.drafter_revision, "drafter"))
    return out, ms.entry.alias if ms.entry else None


def run_pull(out: Any, spec: str, revision: str | None, dry_run: bool, no_draft: bool,
             endpoint: str | None) -> int:
    from dflash_cli.models import hub
    from dflash_cli.ui.render import fmt_bytes

    wanted, alias = pull_targets(spec, revision, no_draft)
    cache = hub.default_cache_dir()
    if dry_run:
        if hub.is_offline():
            raise hub.NotDownloadedError("--dry-run asks the Hub for file sizes, but HF_HUB_OFFLINE is set",
                                         hint="unset HF_HUB_OFFLINE to plan a download")
        grand_total = grand_download = 0
        for w in wanted:
            plan = hub.plan_download(w.repo_id, w.revision, endpoint=endpoint)
            grand_total += plan.total_bytes
            grand_download += plan.download_bytes
            _print(f"{w.role} {plan.repo_id} (revision {plan.revision}, commit {plan.commit[:12]}): "
                   f"{len(plan.files)} files, {fmt_bytes(plan.download_bytes)} to download"
                   + (f", {fmt_bytes(plan.cached_bytes)} already cached" if plan.cached_bytes else ""))
            rows = [[f.path, fmt_bytes(f.size), "cached" if f.cached else "download"] for f in plan.files]
            _print(["  " + line for line in table(["FILE", "SIZE", "STATUS"], rows)])
            if plan.skipped:
                _print(f"  skipped (code, pickles, other files): {', '.join(plan.skipped)}")
        _print(f"total: {fmt_bytes(grand_download)} to download"
               + (f" ({fmt_bytes(grand_total - grand_download)} already cached)" if grand_total > grand_download
                  else ""))
        out.info(f"dry run: nothing downloaded; files would go to {cache}")
        return EXIT_OK

    offline = hub.is_offline()
    plans = {}
    if not offline:  # ask about every repo first, so a missing drafter fails before the target downloads
        for w in wanted:
            plans[w.repo_id] = hub.plan_download(w.repo_id, w.revision, endpoint=endpoint)
    bars = progress_enabled(out.err)
    folders: list[tuple[Wanted, Path]] = []
    for w in wanted:
        plan = plans.get(w.repo_id)
        if plan is not None:
            left = fmt_bytes(plan.download_bytes)
            out.info(f"pulling {w.role} {w.repo_id}: {left} to download"
                     + (f" ({fmt_bytes(plan.cached_bytes)} already cached)" if plan.cached_bytes else ""))
        if bars and plan is not None and plan.download_bytes:
            with _rich_progress(out.err) as progress:
                folder = hub.pull(w.repo_id, w.revision, endpoint=endpoint,
                                  tqdm_class=make_tqdm_class(progress, w.repo_id))
        else:
            folder = hub.pull(w.repo_id, w.revision, endpoint=endpoint, tqdm_class=make_tqdm_class(None, ""))
        folders.append((w, folder))
    width = max(len(w.role) for w, _ in folders)
    for w, folder in folders:
        out.info(f"{w.role:<{width}}  {w.repo_id} -> {folder}", dim=False)
    name = alias or spec
    out.info(f"ready: dflash-cli chat -m {name}" if len(folders) > 1 or alias else
             f"ready: dflash-cli chat -m {name} (no drafter pulled: plain decoding unless --draft)")
    return EXIT_OK


@click.command()
@click.argument("model")
@click.option("--revision", default=None, help="Branch, tag or commit of the target (default: main, "
              "or the registry's pinned commit).")
@click.option("--dry-run", is_flag=True, help="Print the files and sizes a pull would fetch; download nothing.")
@click.option("--no-draft", is_flag=True, help="Pull the target only, not its drafter.")
@endpoint_option
@common_options
def pull(model, revision, dry_run, no_draft, endpoint, color, debug):
    """Download MODEL (a known name or a Hub repo id) and its drafter into the Hugging Face cache.

    Only configs, tokenizer files and safetensors weights are fetched (never code or pickles); files
    already cached are not fetched again, and a transfer cut off mid-file is resumed from where it
    stopped (within the same run). The cache is HF_HUB_CACHE (or HF_HOME/hub); HF_TOKEN is used for
    gated repos.

    \b
    Examples:
      dflash-cli pull qwen3-8b
      dflash-cli pull Qwen/Qwen3-8B --dry-run
      dflash-cli pull qwen3-4b --no-draft
    """
    _run(color, debug, lambda out: run_pull(out, model, revision, dry_run, no_draft, endpoint))


# ----------------------------------------------------------------------------------------------- list
def local_rows(registry: dict[str, Any]) -> list[dict[str, Any]]:
    from dflash_cli.models import hub

    roles = _roles(registry)
    rows = []
    for repo in hub.list_local():
        alias, role = roles.get(repo.repo_id.lower(), (None, None))
        rows.append({"repo_id": repo.repo_id, "pair": alias, "role": role, "size_bytes": repo.size_on_disk,
                     "revisions": list(repo.revisions), "refs": list(repo.refs),
                     "last_modified": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(repo.last_modified)),
                     "last_modified_ts": repo.last_modified, "path": str(repo.path)})
    return rows


def known_rows(registry: dict[str, Any]) -> list[dict[str, Any]]:
    from dflash_cli.models.registry import BUILTIN_MODELS

    rows = [{"alias": alias, "target": e.target, "drafter": e.drafter, "block_size": e.block_size,
             "thinking": e.thinking, "unsupported": e.unsupported, "notes": e.notes, "source": e.source}
            for alias, e in sorted(registry.items())]
    rows += [{"alias": name, "target": "(built in)", "drafter": None, "block_size": None, "thinking": None,
              "unsupported": None, "notes": text, "source": "built-in"} for name, text in BUILTIN_MODELS.items()]
    return rows


def _opt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)


def run_list(out: Any, quiet: bool, as_json: bool, known: bool) -> int:
    from dflash_cli.ui.render import fmt_bytes

    registry = _registry()
    if known:
        rows = known_rows(registry)
        if as_json:
            _print(json.dumps(rows, indent=2))
        elif quiet:
            _print([r["alias"] for r in rows])
        else:
            _print(table(["NAME", "TARGET", "DRAFTER", "BLOCK", "THINKING", "STATUS"],
                         [[r["alias"], r["target"], _opt(r["drafter"]), _opt(r["block_size"]), _opt(r["thinking"]),
                           f"unsupported: {r['unsupported']}" if r["unsupported"] else "ok"] for r in rows]))
        return EXIT_OK
    rows = local_rows(registry)
    if as_json:
        for r in rows:
            r.pop("last_modified_ts")
        _print(json.dumps(rows, indent=2))
        return EXIT_OK
    if quiet:
        if rows:
            _print([r["repo_id"] for r in rows])
        return EXIT_OK
    if not rows:
        from dflash_cli.models import hub

        out.info(f"no models in {hub.default_cache_dir()}; try: dflash-cli pull qwen3-8b "
                 "(dflash-cli list --known shows the known pairs)")
        return EXIT_OK
    now = time.time()
    _print(table(["REPO", "PAIR", "ROLE", "SIZE", "REFS", "REVISION", "MODIFIED"],
                 [[r["repo_id"], _opt(r["pair"]), _opt(r["role"]), fmt_bytes(r["size_bytes"]),
                   ",".join(r["refs"]) or "-",
                   (r["revisions"][0][:12] if r["revisions"] else "-")
                   + (f" (+{len(r['revisions']) - 1})" if len(r["revisions"]) > 1 else ""),
                   _ago(r["last_modified_ts"], now)] for r in rows]))
    return EXIT_OK


def _list_command(name: str, hidden: bool) -> click.Command:
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
        _run(color, debug, lambda out: run_list(out, quiet, as_json, known))

    return command


list_cmd = _list_command("list", hidden=False)
ls_cmd = _list_command("ls", hidden=True)


# ----------------------------------------------------------------------------------------------- show
def available_memory() -> tuple[int, str]:
    """(bytes, what): free GPU memory when CUDA is available, else MemAvailable from /proc/meminfo."""
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        try:
            import torch

            if torch.cuda.is_available():
                free, _total = torch.cuda.mem_get_info()
                return int(free), f"free memory on {torch.cuda.get_device_name(0)}"
        except Exception:  # noqa: BLE001 - a broken CUDA setup falls back to RAM
            pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "available RAM (no CUDA device)"
    except OSError:
        pass
    return 0, "unknown (no CUDA device, no /proc/meminfo)"


def _resolve_show(spec: str, registry: dict[str, Any]):
    """(target repo or folder, target revision, drafter, drafter revision, entry, kind); unsupported pairs too."""
    from dflash_cli.models.registry import BUILTIN_MODELS, find_pair, looks_like_repo_id

    entry = find_pair(spec, registry)
    if Path(spec).expanduser().is_dir():
        return (str(Path(spec).expanduser()), None, entry.drafter if entry else None,
                entry.drafter_revision if entry else None, entry, "folder")
    if spec.lower() in BUILTIN_MODELS:
        return spec.lower(), None, None, None, None, "builtin"
    if entry is not None:
        return entry.target, entry.target_revision, entry.drafter, entry.drafter_revision, entry, "repo"
    if looks_like_repo_id(spec):
        return spec, None, None, None, None, "repo"
    raise _unknown(spec, registry)


def _configs(repo: str | None, revision: str | None, kind: str, endpoint: str | None) -> tuple[dict | None, str]:
    """(config dict or None, a note on where it came from or why it is missing)."""
    from dflash_cli.models import hub

    if repo is None:
        return None, "no drafter"
    if kind == "folder":
        path = Path(repo) / "config.json"
        if not path.is_file():
            return None, f"{path} does not exist"
        return json.loads(path.read_text()), str(path)
    try:
        folder = hub.fetch_configs(repo, revision, endpoint=endpoint)
    except hub.NotDownloadedError:
        return None, "not downloaded, and HF_HUB_OFFLINE is set (unset it to fetch config.json only)"
    except (hub.HubError, CheckpointError) as error:
        return None, str(error)
    try:
        return json.loads((folder / "config.json").read_text()), str(folder / "config.json")
    except (OSError, ValueError) as error:
        return None, f"cannot read config.json: {error}"


def config_summary(target: dict | None, drafter: dict | None) -> dict[str, Any]:
    from dflash_cli.models.plan import drafter_block_size, text_config

    out: dict[str, Any] = {}
    if target is not None:
        t = text_config(target)
        out["target"] = {k: t.get(k) for k in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size",
                                               "num_attention_heads", "num_key_value_heads",
                                               "max_position_embeddings")}
        out["target"]["architectures"] = target.get("architectures")
    if drafter is not None:
        dflash = drafter.get("dflash_config") or {}
        out["drafter"] = {"hidden_size": drafter.get("hidden_size"),
                          "num_hidden_layers": drafter.get("num_hidden_layers"),
                          "vocab_size": drafter.get("vocab_size"),
                          "block_size": drafter_block_size(drafter),
                          "target_layer_ids": dflash.get("target_layer_ids", drafter.get("target_layer_ids")),
                          "mask_token_id": dflash.get("mask_token_id", drafter.get("mask_token_id"))}
    return out


def _source(ctx: click.Context, param: str, config_key: str | None, env: str | None) -> str:
    from click.core import ParameterSource

    src = ctx.get_parameter_source(param)
    if src == ParameterSource.COMMANDLINE:
        return "flag"
    if src == ParameterSource.ENVIRONMENT:
        return f"env {env}"
    if config_key and config_key in _config_values():
        return f"config file {S.config_path()}"
    return "default"


def run_show(out: Any, ctx_sources: dict[str, str], spec: str, as_json: bool, context: int, quant: str,
             endpoint: str | None) -> int:
    from dflash_cli.models.plan import format_plan, plan_memory
    from dflash_cli.models.registry import BUILTIN_MODELS

    registry = _registry()
    target, t_rev, drafter, d_rev, entry, kind = _resolve_show(spec, registry)
    if kind == "builtin":
        info = {"name": target, "builtin": True, "description": BUILTIN_MODELS[target]}
        _print(json.dumps(info, indent=2) if as_json else [f"name      {target}", f"built in  {info['description']}"])
        return EXIT_OK
    t_cfg, t_note = _configs(target, t_rev, kind, endpoint)
    d_cfg, d_note = _configs(drafter, d_rev, "repo", endpoint) if drafter else (None, "no drafter")
    summary = config_summary(t_cfg, d_cfg)
    plan = None
    mem_bytes, mem_what = (0, "")
    if t_cfg is not None:
        mem_bytes, mem_what = available_memory()
        plan = plan_memory(t_cfg, d_cfg, quant=quant, context_tokens=context, available_bytes=mem_bytes)
    info = {
        "name": entry.alias if entry else None, "target": target, "target_revision": t_rev,
        "drafter": drafter, "drafter_revision": d_rev,
        "block_size": entry.block_size if entry else None, "thinking": entry.thinking if entry else None,
        "unsupported": entry.unsupported if entry else None, "notes": entry.notes if entry else "",
        "source": entry.source if entry else None,
        "configs": {"target": t_note, "drafter": d_note}, "summary": summary,
        "settings": {"quant": {"value": quant, "from": ctx_sources["quant"]},
                     "context": {"value": context, "from": ctx_sources["context"]}},
        "memory": None,
    }
    if plan is not None:
        info["memory"] = {"available_bytes": plan.available_bytes, "available": mem_what, "quant": plan.quant,
                          "context_tokens": plan.context_tokens, "block_size": plan.block_size,
                          "components": plan.components, "total_bytes": plan.total, "fits": plan.fits,
                          "suggestions": plan.suggestions}
    if as_json:
        _print(json.dumps(info, indent=2))
        return EXIT_OK
    rows = [("name", info["name"] or "-"),
            ("target", target + (f" @ {t_rev}" if t_rev else "")),
            ("drafter", (drafter or "none (plain decoding)") + (f" @ {d_rev}" if d_rev else ""))]
    if entry is not None:
        rows += [("block size", _opt(entry.block_size)), ("thinking", _opt(entry.thinking)),
                 ("from", entry.source)]
        if entry.unsupported:
            rows.append(("unsupported", entry.unsupported))
        if entry.notes:
            rows.append(("notes", entry.notes))
    lines = [f"{k:<12}{v}" for k, v in rows]
    lines += ["", "configs"]
    t = summary.get("target")
    if t:
        lines.append(f"  target    {t['model_type']}, hidden {t['hidden_size']}, {t['num_hidden_layers']} layers, "
                     f"vocab {t['vocab_size']}, heads {t['num_attention_heads']}/{t['num_key_value_heads']}, "
                     f"max positions {t['max_position_embeddings']}")
    else:
        lines.append(f"  target    {t_note}")
    d = summary.get("drafter")
    if d:
        lines.append(f"  drafter   hidden {d['hidden_size']}, {d['num_hidden_layers']} layers, "
                     f"block size {d['block_size']}, taps {d['target_layer_ids']}, mask id {d['mask_token_id']}")
    else:
        lines.append(f"  drafter   {d_note}")
    lines += ["", "settings",
              f"  quant     {quant} ({ctx_sources['quant']})",
              f"  context   {context:,} tokens ({ctx_sources['context']})"]
    lines += ["", f"memory plan (against {mem_what})" if plan else "memory plan"]
    if plan is not None:
        lines += ["  " + line for line in format_plan(plan)]
    else:
        lines.append("  unavailable: the target's config.json is needed")
    _print(lines)
    return EXIT_OK


@click.command()
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--context", type=click.IntRange(min=1), default=DEFAULT_CONTEXT, show_default=True,
              help="Context length (tokens) for the memory plan.")
@click.option("--quant", default=None, envvar=S.ENV["quant"], show_envvar=True,
              type=click.Choice(["auto", "bf16", "fp16", "int8", "nf4", "none"], case_sensitive=False),
              help="Target quantization for the memory plan [default: config file, else bf16].")
@endpoint_option
@common_options
@click.pass_context
def show(ctx, model, as_json, context, quant, endpoint, color, debug):
    """Show a pair: target, drafter, notes, config summary and a memory plan.

    The config files are read from the cache, or fetched (config.json only) when online.

    \b
    Examples:
      dflash-cli show qwen3-8b
      dflash-cli show qwen3-8b --quant nf4 --context 32768
    """
    sources = {"quant": _source(ctx, "quant", "quant", S.ENV["quant"]),
               "context": _source(ctx, "context", None, None)}
    if quant is None:
        quant = str(_config_values().get("quant") or DEFAULT_SHOW_QUANT)
    _run(color, debug, lambda out: run_show(out, sources, model, as_json, context, quant, endpoint))


# ----------------------------------------------------------------------------------------------- rm
def rm_targets(spec: str) -> tuple[list[Any], list[str]]:
    """(cached LocalRepos to remove, repo ids of the pair that are not cached)."""
    from dflash_cli.models import hub
    from dflash_cli.models.registry import looks_like_repo_id

    registry = _registry()
    if spec.lower() in registry:
        entry = registry[spec.lower()]
        ids = [entry.target] + ([entry.drafter] if entry.drafter else [])
    elif looks_like_repo_id(spec):
        ids = [spec]
    else:
        raise _unknown(spec, registry)
    local = {r.repo_id.lower(): r for r in hub.list_local()}
    found = [local[i.lower()] for i in ids if i.lower() in local]
    missing = [i for i in ids if i.lower() not in local]
    if not found:
        raise hub.NotDownloadedError(f"{spec} is not in the local cache ({', '.join(ids)})",
                                     hint="`dflash-cli ls` shows what is downloaded")
    return found, missing


def run_rm(out: Any, spec: str, yes: bool) -> int:
    from dflash_cli.models import hub
    from dflash_cli.ui.render import _isatty, fmt_bytes

    found, missing = rm_targets(spec)
    total = sum(r.size_on_disk for r in found)
    for r in found:
        out.info(f"  {r.repo_id}  {fmt_bytes(r.size_on_disk)}  ({len(r.revisions)} revision"
                 f"{'s' if len(r.revisions) != 1 else ''})", dim=False)
    for m in missing:
        out.info(f"  {m}  (not downloaded)")
    what = f"{len(found)} repo{'s' if len(found) != 1 else ''} ({fmt_bytes(total)})"
    if not yes:
        if not _isatty(sys.stdin):
            out.error(f"not removing {what} without confirmation: stdin is not a terminal",
                      hint=f"pass -y to remove without asking: dflash-cli rm {spec} -y")
            return EXIT_USAGE
        if not click.confirm(f"Remove {what} from {hub.default_cache_dir()}?", default=False, err=True):
            out.info("nothing removed")
            return EXIT_OK
    freed = hub.remove([r.repo_id for r in found])
    out.info(f"removed {', '.join(r.repo_id for r in found)}: freed {fmt_bytes(freed)}", dim=False)
    return EXIT_OK


@click.command()
@click.argument("model")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@common_options
def rm(model, yes, color, debug):
    """Remove MODEL from the Hugging Face cache: a known name removes its target and drafter, a repo id
    only that repository.

    \b
    Examples:
      dflash-cli rm qwen3-8b
      dflash-cli rm z-lab/Qwen3-8B-DFlash-b16 -y
    """
    _run(color, debug, lambda out: run_rm(out, model, yes))


COMMANDS = (pull, list_cmd, ls_cmd, show, rm)
