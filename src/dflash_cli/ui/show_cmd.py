"""`dflash-cli show`: a pair's configs, memory plan and where each setting comes from (no weights needed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from dflash_cli import settings as S
from dflash_cli.engine.errors import CheckpointError
from dflash_cli.ui.errors import EXIT_OK
from dflash_cli.ui.models_cmd import (_config_values, _opt, _print, _registry, _run, _unknown, common_options,
                                      endpoint_option)

DEFAULT_CONTEXT = 8192
DEFAULT_SHOW_QUANT = "bf16"


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
    from dflash_cli.engine.config import drafter_block_size, drafter_mask_token_id, drafter_taps, text_config

    out: dict[str, Any] = {}
    if target is not None:
        t = text_config(target)
        out["target"] = {k: t.get(k) for k in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size",
                                               "num_attention_heads", "num_key_value_heads",
                                               "max_position_embeddings")}
        out["target"]["architectures"] = target.get("architectures")
    if drafter is not None:
        out["drafter"] = {"hidden_size": drafter.get("hidden_size"),
                          "num_hidden_layers": drafter.get("num_hidden_layers"),
                          "vocab_size": drafter.get("vocab_size"),
                          "block_size": drafter_block_size(drafter),
                          "target_layer_ids": drafter_taps(drafter), "mask_token_id": drafter_mask_token_id(drafter)}
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
