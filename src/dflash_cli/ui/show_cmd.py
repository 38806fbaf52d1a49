"""`dflash-cli show`: a pair's configs, memory plan and where each setting comes from (no weights needed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from dflash_cli import settings as S
from dflash_cli.engine.dtypes import QUANT_CHOICES, half_caches_asked
from dflash_cli.engine.errors import CheckpointError
from dflash_cli.ui.common import cell, config_values, echo, registry, run_plain
from dflash_cli.ui.errors import EXIT_OK
from dflash_cli.ui.options import common_options, device_map_option, endpoint_option, max_memory_option

DEFAULT_SHOW_QUANT = "bf16"


def plan_budget(device: str, context: int) -> tuple[int, str]:
    """(bytes, what): free memory on the device `generate --device` would use, as generate's preflight
    reads it."""
    available, what, _, _ = plan_device(device, context)
    return available, what


def plan_device(device: str, context: int) -> tuple[int, str, str | None, str]:
    """plan_budget, the device it read (None: unknown) and the dtype a target runs in there unquantized."""
    from dflash_cli.models.memory.preflight import memory_budget

    budget = memory_budget(device, None, context)
    if budget is None:
        return 0, "unknown (no /proc/meminfo)", None, "bf16"
    return budget.available_bytes, f"free {budget.where} on {budget.device}", budget.device, budget.dtype


def mxfp4_on(target: dict, device: str | None) -> tuple[bool, str | None]:
    """(experts kept packed, why) for an MXFP4 target on `device`; (False, None) for any other target."""
    from dflash_cli.models.memory.params import prequantized
    from dflash_cli.models.memory.preflight import mxfp4_kept

    if prequantized(target) != "mxfp4":
        return False, None
    if device is None:
        return False, "the device is unknown"
    return mxfp4_kept(device)


def read_configs(where: str | None, revision: str | None, endpoint: str | None) -> tuple[dict | None, str]:
    """(config dict or None, a note on where it came from or why it is missing)."""
    from dflash_cli.engine.pairing import read_config_file
    from dflash_cli.models import cache
    from dflash_cli.models.resolve import find_config

    if where is None:
        return None, "no drafter"
    kind = "folder" if Path(where).is_dir() else "repo"
    try:
        path = find_config(kind, where, revision, endpoint)
        return read_config_file(path), str(path)
    except cache.NotDownloadedError:
        return None, "not downloaded, and HF_HUB_OFFLINE is set (unset it to fetch config.json only)"
    except (cache.HubError, CheckpointError) as error:
        return None, str(error)


def config_summary(target: dict | None, drafter: dict | None) -> dict[str, Any]:
    from dflash_cli.engine.hf_config import drafter_block_size, drafter_mask_token_id, drafter_taps, text_config

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


def option_source(ctx: click.Context, param: str, config_key: str | None, env: str | None) -> str:
    from click.core import ParameterSource

    src = ctx.get_parameter_source(param)
    if src == ParameterSource.COMMANDLINE:
        return "flag"
    if src == ParameterSource.ENVIRONMENT:
        return f"env {env}"
    if config_key and config_key in config_values():
        return f"config file {S.config_path()}"
    return "default"


def _memory_info(plan: Any, mem_what: str) -> dict[str, Any]:
    return {"available_bytes": plan.available_bytes, "available": mem_what, "quant": plan.quant,
            "context_tokens": plan.context_tokens, "block_size": plan.block_size,
            "components": plan.components, "total_bytes": plan.total, "fits": plan.fits,
            "suggestions": plan.suggestions}


def _split_info(split_plan: Any) -> dict[str, Any]:
    return {"strategy": split_plan.strategy, "quant": split_plan.quant, "fits": split_plan.fits,
            "offloaded_layers": split_plan.offloaded_layers,
            "devices": [{"device": s.device, "available_bytes": s.available,
                         "first_layer": s.first_layer, "layers": s.layers, "weights_bytes": s.weights,
                         "kv_bytes": s.kv, "working_bytes": s.working, "total_bytes": s.total,
                         "offload": s.offload} for s in split_plan.shares]}


def _identity_lines(info: dict[str, Any], t_rev: str | None, d_rev: str | None, builtin: str | None,
                    entry: Any) -> list[str]:
    """The pair's name, target, drafter and registry facts, one aligned line each."""
    rows = [("name", info["name"] or "-"),
            ("target", info["target"] + (f" @ {t_rev}" if t_rev else "")),
            ("drafter", (info["drafter"] or "none (plain decoding)") + (f" @ {d_rev}" if d_rev else ""))]
    if builtin is not None:
        rows.append(("built in", builtin))
    if entry is not None:
        tp = f", tp {entry.serve_tp}" if entry.serve_tp else ""
        runs = f"on a multi-GPU server (serve-cmd{tp}), used with --engine URL" if entry.engine_only else "here"
        rows += [("block size", cell(entry.block_size)), ("thinking", cell(entry.thinking)), ("runs", runs),
                 ("from", entry.source)]
        if entry.unsupported:
            rows.append(("unsupported", entry.unsupported))
        if entry.notes:
            rows.append(("notes", entry.notes))
    return [f"{k:<12}{v}" for k, v in rows]


def _config_lines(summary: dict[str, Any], t_note: str, d_note: str) -> list[str]:
    """The two configs in one line each (or why they could not be read)."""
    t, d = summary.get("target"), summary.get("drafter")
    target = (f"{t['model_type']}, hidden {t['hidden_size']}, {t['num_hidden_layers']} layers, "
              f"vocab {t['vocab_size']}, heads {t['num_attention_heads']}/{t['num_key_value_heads']}, "
              f"max positions {t['max_position_embeddings']}") if t else t_note
    drafter = (f"hidden {d['hidden_size']}, {d['num_hidden_layers']} layers, block size {d['block_size']}, "
               f"taps {d['target_layer_ids']}, mask id {d['mask_token_id']}") if d else d_note
    return [f"  target    {target}", f"  drafter   {drafter}"]


def run_show(out: Any, ctx_sources: dict[str, str], value: str, as_json: bool, context: int, quant: str,
             device: str, endpoint: str | None, device_map: str | None = None,
             max_memory: str | None = None) -> int:
    from dflash_cli.engine.placement import resolve_split
    from dflash_cli.models.memory.plan import format_server
    from dflash_cli.models.memory.split import format_split, plan_split
    from dflash_cli.models.registry import BUILTIN_MODELS
    from dflash_cli.models.resolve import resolve_spec

    split = resolve_split(device, device_map, max_memory)  # bad settings: one line, before anything else
    spec = resolve_spec(value, registry(), allow_unsupported=True, store=True)
    target, t_rev, drafter, d_rev, entry = (spec.target, spec.target_revision, spec.drafter, spec.drafter_revision,
                                            spec.entry)
    builtin = BUILTIN_MODELS.get(spec.alias or "") if spec.kind == "builtin" else None
    if builtin is not None:  # the converted SmolLM2 folder (made by the first run) and the shipped drafter
        from dflash_cli.models.smollm2 import smollm2_dir

        target = str(smollm2_dir())
    if builtin is not None and not Path(target, "config.json").is_file():
        t_cfg, t_note = None, f"not converted yet: the first run converts it into {target} (about 20 s, offline)"
    else:
        t_cfg, t_note = read_configs(target, t_rev, endpoint)
    d_cfg, d_note = read_configs(drafter, d_rev, endpoint)
    summary = config_summary(t_cfg, d_cfg)
    engine_only = entry is not None and entry.engine_only
    plan, server, mem_what, mxfp4_why = _memory_plan(t_cfg, d_cfg, quant, context, device, engine_only)
    split_plan = None
    if t_cfg is not None and split is not None:
        quant_for_split = "bf16" if quant in ("auto", "none") else quant
        split_plan = plan_split(t_cfg, d_cfg, devices=split[1], strategy=split[0], quant=quant_for_split,
                                context_tokens=context)
    info: dict[str, Any] = {
        "name": entry.alias if entry else spec.alias if builtin else None, "target": target, "target_revision": t_rev,
        "drafter": drafter, "drafter_revision": d_rev,
        "block_size": entry.block_size if entry else None, "thinking": entry.thinking if entry else None,
        "runs": entry.runs if entry else "local", "serve_tp": entry.serve_tp if entry else None,
        "unsupported": entry.unsupported if entry else None, "notes": entry.notes if entry else "",
        "source": entry.source if entry else "built-in" if builtin else None, "builtin": builtin is not None,
        "configs": {"target": t_note, "drafter": d_note}, "summary": summary,
        "settings": {"quant": {"value": quant, "from": ctx_sources["quant"]},
                     "context": {"value": context, "from": ctx_sources["context"]},
                     "device": {"value": device, "from": ctx_sources["device"]}},
        "memory": None,
    }
    if plan is not None:
        info["memory"] = _memory_info(plan, mem_what)
        if mxfp4_why is not None:
            info["memory"]["mxfp4"] = {"packed": plan.mxfp4_packed, "why": mxfp4_why}
    if server is not None:
        info["server"] = _server_info(server)
    if split_plan is not None:
        info["split"] = _split_info(split_plan)
    if as_json:
        echo(json.dumps(info, indent=2))
        return EXIT_OK
    lines = _identity_lines(info, t_rev, d_rev, builtin, entry) + ["", "configs"]
    lines += _config_lines(summary, t_note, d_note)
    lines += ["", "settings",
              f"  quant     {quant} ({ctx_sources['quant']})",
              f"  context   {context:,} tokens ({ctx_sources['context']})",
              f"  device    {device} ({ctx_sources['device']})"]
    lines += _memory_lines(plan, mem_what, mxfp4_why)
    if engine_only and entry is not None:
        lines += ["  " + line for line in format_server(server, entry.alias, entry.serve_tp)]
    if split_plan is not None:
        lines += ["", f"per-device plan (--device-map {device_map})"]
        lines += ["  " + line for line in format_split(split_plan)]
    echo(lines)
    return EXIT_OK


def _memory_plan(t_cfg: dict | None, d_cfg: dict | None, quant: str, context: int, device: str,
                 engine_only: bool) -> tuple[Any, Any, str, str | None]:
    """(memory plan, server estimate, what memory the plan is for, why MXFP4 is or is not packed) of the pair on
    this machine; Nones where the target's config is not known. A pair only a server runs gets the server's
    estimate in place of knobs that would not make it fit here."""
    from dataclasses import replace

    from dflash_cli.models.memory.plan import plan_memory, server_estimate
    from dflash_cli.models.memory.sizes import cache_value_bytes

    if t_cfg is None:
        return None, None, "", None
    mem_bytes, mem_what, planned_on, dtype = plan_device(device, context)
    packed, mxfp4_why = mxfp4_on(t_cfg, planned_on)
    half = half_caches_asked() and planned_on == "cpu"
    plan = plan_memory(t_cfg, d_cfg, quant=quant, context_tokens=context, available_bytes=mem_bytes,
                       mxfp4_packed=packed, kv_dtype_bytes=cache_value_bytes(quant, dtype, half))
    if not engine_only:
        return plan, None, mem_what, mxfp4_why
    return (replace(plan, alternatives=()), server_estimate(t_cfg, d_cfg, context_tokens=context), mem_what,
            mxfp4_why)


def _server_info(server: Any) -> dict[str, Any]:
    """--json's "server": what a multi-GPU server needs for a pair that does not run here."""
    return {"weights_bytes": server.target_bytes, "weights_format": server.target_format,
            "drafter_bytes": server.drafter_bytes, "kv_bytes": server.kv_bytes, "total_bytes": server.total,
            "context_tokens": server.context_tokens,
            "gpus": [{"gpu_bytes": size, "count": n} for size, n in server.gpus]}


def _memory_lines(plan: Any, mem_what: str, mxfp4_why: str | None) -> list[str]:
    """The text of the memory plan (and what becomes of MXFP4 experts)."""
    from dflash_cli.models.memory.plan import format_plan

    lines = ["", f"memory plan (against {mem_what})" if plan else "memory plan"]
    if plan is None:
        return lines + ["  unavailable: the target's config.json is needed"]
    lines += ["  " + line for line in format_plan(plan)]
    if mxfp4_why is not None:
        state = "kept packed" if plan.mxfp4_packed else f"dequantized to {plan.quant} when loaded"
        lines.append(f"  MXFP4 experts {state}: {mxfp4_why}")
    return lines


@click.command()
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--context", "--max-context", "context", type=click.IntRange(min=1), default=None,
              envvar=S.ENV["max_context"], show_envvar=True,
              help="Context length (tokens) for the memory plan [default: max_context of the config file, "
                   f"else {S.DEFAULT_MAX_CONTEXT}, as generate].")
@click.option("--quant", default=None, envvar=S.ENV["quant"], show_envvar=True,
              type=click.Choice(["auto", "bf16", "fp16", *QUANT_CHOICES], case_sensitive=False),
              help="Target quantization for the memory plan [default: config file, else bf16].")
@click.option("--device", default=None, envvar=S.ENV["device"], show_envvar=True,
              help=f"Device whose free memory the plan is against [default: config file, else {S.DEFAULT_DEVICE}, "
                   "as generate].")
@device_map_option(default=None, show_default=False,
                   help="Also plan the target split over the devices present, as generate would [default: config "
                        "file, else none].")
@max_memory_option(help="Memory per device for --device-map, e.g. 0=14GiB,1=14GiB,cpu=30GiB.")
@endpoint_option
@common_options
@click.pass_context
def show(ctx, model, as_json, context, quant, device, device_map, max_memory, endpoint, color, debug):
    """Show a pair: target, drafter, notes, config summary and a memory plan.

    The config files are read from the cache, or fetched (config.json only) when online. The plan uses
    the context and device generate would use.

    \b
    Examples:
      dflash-cli show qwen3-8b
      dflash-cli show qwen3-8b --quant nf4 --context 32768
    """
    sources = {"quant": option_source(ctx, "quant", "quant", S.ENV["quant"]),
               "context": option_source(ctx, "context", "max_context", S.ENV["max_context"]),
               "device": option_source(ctx, "device", "device", S.ENV["device"])}
    values = config_values()
    quant = quant or str(values.get("quant") or DEFAULT_SHOW_QUANT)
    context = context or int(values.get("max_context") or S.DEFAULT_MAX_CONTEXT)
    device = device or str(values.get("device") or S.DEFAULT_DEVICE)
    device_map = device_map or str(values.get("device_map") or S.DEFAULT_DEVICE_MAP)
    max_memory = max_memory or values.get("max_memory")
    run_plain(color, debug, lambda out: run_show(out, sources, model, as_json, context, quant, device, endpoint,
                                                 device_map, max_memory))
