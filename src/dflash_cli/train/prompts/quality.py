"""Cheap checks on training prompts a model wrote itself (train/prompts/self_written.py): what to keep, what repeats,
what kind of request each is, and a summary of a set (category mix, lengths, distinct n-grams, duplicates).

Near-duplicates are found by MinHash over word 3-grams (16 bands of 2 rows narrow the candidates, then the
exact Jaccard similarity of the two 3-gram sets decides), so a set of tens of thousands is checked in
seconds. Hashes are crc32-based, never Python's salted `hash`: a seed gives the same set in every process.
"""

from __future__ import annotations

import re
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

MIN_WORDS, MAX_CHARS = 3, 2000
# The share of a prompt's letters that must be Latin ones (SmolLM2 and most small instruct models are tuned
# mostly in English: a prompt in another script is usually a drift the reply will follow badly).
LATIN_SHARE = 0.8
NEAR_DUPLICATE = 0.5  # Jaccard similarity of word 3-gram sets from which two prompts count as one
_WORD = re.compile(r"\w+", re.UNICODE)
_PERMUTATIONS, _BANDS = 32, 16
_PRIME = (1 << 61) - 1
_rng = np.random.default_rng(20241203)
_A = _rng.integers(1, 1 << 31, _PERMUTATIONS, dtype=np.uint64)
_B = _rng.integers(0, 1 << 31, _PERMUTATIONS, dtype=np.uint64)


def rejection(text: str, ended: bool) -> str | None:
    """Why a sampled user turn is not kept as a prompt, or None: `unfinished` (no end of turn before the token
    limit), `short`, `long`, `broken` (undecodable bytes) or `script` (mostly letters of a non-Latin script)."""
    if not ended:
        return "unfinished"
    if "\ufffd" in text:
        return "broken"
    if len(_WORD.findall(text)) < MIN_WORDS:
        return "short"
    if len(text) > MAX_CHARS:
        return "long"
    letters = [c for c in text if c.isalpha()]
    if letters and sum(c.isascii() or "\u00c0" <= c <= "\u024f" for c in letters) < LATIN_SHARE * len(letters):
        return "script"
    return None


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def shingles(text: str, n: int = 3) -> set[str]:
    """The word n-grams of a prompt, lowercased (the whole prompt when it is shorter than n words)."""
    w = words(text)
    return {" ".join(w[i : i + n]) for i in range(max(1, len(w) - n + 1))}


class NearDuplicates:
    """Remembers prompts and tells whether a new one is a near-duplicate of one remembered (Jaccard >= threshold)."""

    def __init__(self, threshold: float = NEAR_DUPLICATE):
        self.threshold = threshold
        self.kept: list[set[str]] = []
        self.buckets: dict[tuple[int, bytes], list[int]] = {}

    def add(self, text: str) -> bool:
        """Remembers `text` unless it is a near-duplicate of a remembered prompt; returns whether it was new."""
        grams = shingles(text)
        keys = self._band_keys(grams)
        seen: set[int] = set()
        for key in keys:
            for j in self.buckets.get(key, ()):
                if j not in seen:
                    seen.add(j)
                    if _jaccard(grams, self.kept[j]) >= self.threshold:
                        return False
        for key in keys:
            self.buckets.setdefault(key, []).append(len(self.kept))
        self.kept.append(grams)
        return True

    @staticmethod
    def _band_keys(grams: set[str]) -> list[tuple[int, bytes]]:
        hashes = np.fromiter((zlib.crc32(g.encode()) for g in grams), dtype=np.uint64, count=len(grams))
        signature = ((_A[:, None] * hashes[None, :] + _B[:, None]) % _PRIME).min(axis=1)
        rows = _PERMUTATIONS // _BANDS
        return [(b, signature[b * rows : (b + 1) * rows].tobytes()) for b in range(_BANDS)]


def _jaccard(a: set[str], b: set[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


# -- categories --------------------------------------------------------------------------------------------

_CODE = re.compile(
    r"\b(python|javascript|typescript|java|c\+\+|c#|golang|rust|ruby|php|kotlin|swift|bash|shell|sql|html|css|"
    r"regex|function|functions|code|coding|program|programming|script|algorithm|compile[rd]?|debug|bug|api|"
    r"class|method|variable|array|string|loop|recursion|json|database|query|git|linux|terminal|library|"
    r"framework|react|django|numpy|pandas)\b|`|def |\bint\b|=>|\(\)|\{|\};", re.IGNORECASE)
_MATH = re.compile(
    r"\b(solve|equation|calculate|compute|how many|how much|average|percent|percentage|sum|product|"
    r"probability|fraction|integer|integers|prime|divisible|derivative|integral|area|perimeter|volume|"
    r"triangle|circle|square root|algebra|geometry|math|mathematics|arithmetic|multiply|divide|ratio|"
    r"mean|median|factor|factors|digits?)\b|\d+\s*[-+*/^=x×÷]\s*\d+|\d+\s*%", re.IGNORECASE)
_REQUEST = re.compile(
    r"\?|\b(please|can you|could you|would you|write|explain|describe|tell me|give me|help|list|suggest|"
    r"recommend|create|compose|make|summari[sz]e|rewrite|translate|compare|draft|plan|how|what|why|which|"
    r"who|where|when|should|i need|i want|i'm|i am|i'd like)\b", re.IGNORECASE)


def category(text: str) -> str:
    """math, code, chat (any other request or question) or other, by keyword rules (a cheap guess, not a
    classifier: "what is the area of this garden" is math, "write a story about a coder" code)."""
    math, code = len(_MATH.findall(text)), len(_CODE.findall(text))
    if code and code >= math:
        return "code"
    if math:
        return "math"
    return "chat" if _REQUEST.search(text) else "other"


# -- a summary of a prompt set --------------------------------------------------------------------------

@dataclass
class PromptStats:
    count: int
    categories: dict[str, float]  # share of each category
    words_median: float
    words_p10: float
    words_p90: float
    distinct_1: float  # distinct word unigrams / all unigrams
    distinct_2: float
    near_duplicates: float  # share of the set that is a near-duplicate of an earlier prompt of the set
    first_words: float  # distinct opening three words / prompts
    rejected: dict[str, int] = field(default_factory=dict)  # sampled turns not kept, by reason (self prompts)


def prompt_stats(prompts: Sequence[str], rejected: dict[str, int] | None = None) -> PromptStats:
    """The summary of `prompts` that docs/training.md tabulates for each set."""
    lengths = np.array([len(words(p)) for p in prompts] or [0])
    cats = Counter(category(p) for p in prompts)
    dup = NearDuplicates()
    repeats = sum(not dup.add(p) for p in prompts)
    opening = {" ".join(words(p)[:3]) for p in prompts}
    n = max(len(prompts), 1)
    p10, median, p90 = (float(np.percentile(lengths, q)) for q in (10, 50, 90))
    return PromptStats(len(prompts), {c: cats[c] / n for c in ("math", "code", "chat", "other")}, median, p10, p90,
                       _distinct(prompts, 1), _distinct(prompts, 2), repeats / n, len(opening) / n,
                       dict(rejected or {}))


def _distinct(prompts: Iterable[str], n: int) -> float:
    grams: Counter[tuple[str, ...]] = Counter()
    for p in prompts:
        w = words(p)
        grams.update(tuple(w[i : i + n]) for i in range(len(w) - n + 1))
    total = sum(grams.values())
    return len(grams) / total if total else 0.0
