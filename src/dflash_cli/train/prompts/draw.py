"""What the built-in prompt generators share (demo.py, mix.py, wide.py): the names their templates draw from,
and the loop that draws a set of distinct prompts (mix and wide; demo keeps its own)."""

from __future__ import annotations

import random
from collections.abc import Callable

NAMES = ["Ava", "Ben", "Chloe", "Daniel", "Elena", "Farid", "Grace", "Hugo", "Isla", "Jonas", "Keiko", "Leo",
         "Mia", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wen", "Yusuf", "Zoe",
         "Carlos", "Amara", "Lucas", "Hana", "Omar", "Ingrid", "Mateo", "Nadia", "Pablo", "Sofia", "Theo"]


def draw_distinct(n: int, seed: int, gens: dict[str, Callable[[random.Random], str]],
                  name: str) -> list[tuple[str, str]]:
    """`n` (category, prompt) pairs: each prompt's category is drawn first (40% math, 30% code, 30% chat) and then
    that category's generator is drawn from until it gives a prompt not seen before, so the mix stays the same at
    every n and a smaller n gives a prefix of a larger one."""
    r = random.Random(seed)
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    while len(out) < n:
        x = r.random()
        cat = "math" if x < 0.4 else "code" if x < 0.7 else "chat"
        for _ in range(100_000):
            p = gens[cat](r)
            if p not in seen:
                break
        else:  # pragma: no cover - far beyond the sizes the sets are meant for
            raise ValueError(f"the {name} prompt set ran out of distinct {cat} prompts at {len(out)}")
        seen.add(p)
        out.append((cat, p))
    return out
