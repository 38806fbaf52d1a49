"""`bench --engine`: each prompt once through an OpenAI-compatible server, with the acceptance it reports."""

from __future__ import annotations

from typing import Any

from dflash_cli.engine.errors import InvalidSettingError
from dflash_cli.engine.response import GenerationStats, Step
from dflash_cli.runtime.remote import RemoteRuntime
from dflash_cli.tables import columns


def run_remote_bench(runtime: RemoteRuntime, prompt_sets: dict[str, list[Any]], *, max_new_tokens: int,
                     warmup: int = 2, per_set: int | None = None, think: bool | None = None,
                     on_progress: Any = None) -> dict[str, Any]:
    """Each prompt once through the server (greedy), measured: the server's acceptance, decode tokens/s and
    time to first token, per set and overall. A server has no plain mode to compare with, so no speedup."""
    from dflash_cli.conversation import GenerationSettings

    settings = GenerationSettings(max_tokens=max_new_tokens, temperature=0.0, think=think)
    work = [(name, p) for name, items in prompt_sets.items()
            for p in (list(items)[:per_set] if per_set is not None else list(items))]
    if not work:
        raise InvalidSettingError("no prompts to run")
    progress = on_progress or (lambda done, total, label: None)
    progress(0, len(work), "warming up")

    def run(prompt: str) -> GenerationStats:
        last: Step | None = None
        for last in runtime.stream_chat([{"role": "user", "content": prompt}], settings):
            pass
        assert last is not None  # a reply streams at least its final Step
        return last.stats

    for _, p in work[:max(warmup, 0)]:
        run(p.prompt)
    records = []
    for done, (name, p) in enumerate(work, 1):
        stats = run(p.prompt)
        records.append({"set": name, "id": p.id, "prompt_tokens": stats.prompt_tokens,
                        "generated_tokens": stats.generated_tokens, "decode_tokens": stats.decode_tokens,
                        "decode_seconds": stats.decode_seconds, "time_to_first_token": stats.prefill_seconds,
                        "acceptance_reported": stats.acceptance_reported,
                        "steps": stats.steps, "drafted": stats.drafted, "accepted": stats.accepted,
                        "position_drafted": list(stats.position_drafted),
                        "position_accepted": list(stats.position_accepted), "finish_reason": stats.finish_reason})
        progress(done, len(work), f"{name} {p.id}")
    sets = {name: summarize_remote(name, [r for r in records if r["set"] == name]) for name in prompt_sets
            if any(r["set"] == name for r in records)}
    return {"settings": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "warmup": warmup, "per_set": per_set,
                         "enable_thinking": think},
            "meta": {"engine": runtime.url, "model": runtime.model},
            "sets": sets, "overall": summarize_remote("all", records), "records": records}


def summarize_remote(name: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    """Pooled figures; the acceptance ones only over the replies the server reported them for (else None)."""
    reported = [r for r in records if r["acceptance_reported"]]
    steps = sum(r["steps"] for r in reported)
    drafted, accepted = sum(r["drafted"] for r in reported), sum(r["accepted"] for r in reported)
    width = max((len(r["position_drafted"]) for r in reported), default=0)
    pos_dr = [sum(r["position_drafted"][k] for r in reported if k < len(r["position_drafted"])) for k in range(width)]
    pos_acc = [sum(r["position_accepted"][k] for r in reported if k < len(r["position_accepted"]))
               for k in range(width)]
    seconds = sum(r["decode_seconds"] for r in records)
    return {"name": name, "prompts": len(records), "acceptance_reported": len(reported),
            "tau_pooled": sum(r["decode_tokens"] for r in reported) / steps if steps else None,
            "draft_acceptance": accepted / drafted if drafted else None, "drafted": drafted, "accepted": accepted,
            "per_position_acceptance": [a / d if d else 0.0 for a, d in zip(pos_acc, pos_dr)],
            "decode_tokens_per_second": sum(r["decode_tokens"] for r in records) / seconds if seconds > 0 else 0.0,
            "time_to_first_token": sum(r["time_to_first_token"] for r in records) / len(records) if records else 0.0,
            "generated_tokens": sum(r["generated_tokens"] for r in records)}


def format_remote_table(report: dict[str, Any]) -> list[str]:
    header = ["set", "prompts", "tau pooled", "draft acc", "tok/s", "ttft"]
    summaries = list(report["sets"].values()) + ([report["overall"]] if len(report["sets"]) > 1 else [])
    rows = [[s["name"], str(s["prompts"]),
             f"{s['tau_pooled']:.2f}" if s["tau_pooled"] is not None else "n/a",
             f"{s['draft_acceptance']:.1%}" if s["draft_acceptance"] is not None else "n/a",
             f"{s['decode_tokens_per_second']:.1f}", f"{s['time_to_first_token'] * 1000:.0f}ms"] for s in summaries]
    lines = [*columns([header, *rows], rule=True), ""]
    for s in summaries:
        if not s["acceptance_reported"]:
            lines.append(f"{s['name']}: acceptance not reported by the server")
        elif s["per_position_acceptance"]:
            lines.append(f"{s['name']} per-position acceptance: "
                         + " ".join(f"{p:.0%}" for p in s["per_position_acceptance"]))
    lines.append(f"engine {report['meta']['engine']} · model {report['meta']['model']} · greedy · up to "
                 f"{report['settings']['max_new_tokens']} new tokens · warm-up {report['settings']['warmup']} · "
                 "no plain run to compare with (the server decodes with its own drafter)")
    return lines
