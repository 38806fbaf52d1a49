"""The held-out prompts that decide a demo drafter round stay apart from every built-in prompt set."""

import re
from pathlib import Path

from dflash_cli.prompts.reader import BUILTIN_SETS, load_prompt_set
from dflash_cli.train.prompts import resolve_prompts

HELDOUT = Path(__file__).parent.parent / "benchmarks" / "heldout"


def _words(text: str) -> frozenset[str]:
    return frozenset(re.findall(r"[a-z0-9']+", text.lower()))


def test_heldout_prompts_share_under_half_their_words_with_any_training_or_bench_prompt():
    held = [p.prompt for name in ("math", "code", "chat") for p in load_prompt_set(HELDOUT / f"heldout-{name}.jsonl")]
    assert len(held) == 36
    others = {_words(p) for spec in ("mix:24000", "wide:12000", "demo:6000") for p in resolve_prompts(spec)}
    others |= {_words(p.prompt) for name in BUILTIN_SETS for p in load_prompt_set(name)}
    for prompt in held:
        words = _words(prompt)
        nearest = max(len(words & other) / len(words | other) for other in others)
        assert nearest < 0.5, prompt
