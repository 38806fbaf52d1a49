"""The adaptive controller's round costs kept from one process to the next (engine/adaptive.py).

What a draft, a verify and a plain round cost depends on the machine and the loaded pair, not on the request;
a process that learnt them leaves them in the cache folder, and the next process of the same pair, settings
and machine starts from them. A one-shot `generate` (a shell pipe runs one per command) then drafts, or does
not, from its first round instead of paying a warm-up of full blocks each time, and a drafter that does not pay
here keeps the re-probe schedule it had backed off to. The file is a hint: one that is unreadable, of another
version or out of range is ignored (and replaced at the next save), and the costs read count as one round
each, so what this process measures takes over within a few rounds.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

from dflash_cli import settings as S
from dflash_cli.engine.adaptive import RoundCosts, adopt_costs, shared_costs

VERSION = 2  # 2: drafts timed per block size


def costs_key(target_dir: Path, drafter_dir: Path, **settings: Any) -> dict[str, Any]:
    """What round costs depend on: the pair's folders, the settings that change a forward's cost (format,
    dtype, device, threads, compilation, draft window, kernel build) and the machine."""
    return {"version": VERSION, "target": str(target_dir.resolve()), "drafter": str(drafter_dir.resolve()),
            "machine": f"{platform.node()} {_cpu_model()} {os.cpu_count()}",
            **{name: value if value is None or isinstance(value, (bool, int, float)) else str(value)
               for name, value in sorted(settings.items())}}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def cost_file(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return S.cache_dir() / "round-costs" / f"{digest}.json"


def restore(drafter: object, key: dict[str, Any]) -> bool:
    """Gives `drafter` the round costs an earlier process kept under `key`; False where there are none to
    trust (none kept, another key, a damaged file)."""
    try:
        data = json.loads(cost_file(key).read_text())
        if not isinstance(data, dict) or data.get("key") != key:
            return False
        adopt_costs(drafter, RoundCosts.from_dict(data["costs"]))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return False
    return True


def keep(drafter: object, key: dict[str, Any]) -> None:
    """Leaves `drafter`'s round costs for the next process (whole or not at all; never an error: a read-only
    or full cache folder only costs the next process a warm-up)."""
    costs = shared_costs(drafter)
    if not costs.seconds:
        return
    path, written = cost_file(key), None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as tmp:
            written = tmp.name
            json.dump({"key": key, "costs": costs.to_dict()}, tmp)
        os.replace(written, path)
    except OSError:
        if written is not None:
            with contextlib.suppress(OSError):
                os.unlink(written)
