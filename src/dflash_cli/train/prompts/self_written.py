"""`train --prompts self:N`: user prompts the target writes itself.

An instruction-tuned model was tuned on real user turns, so given its chat template's opening of a user
turn and nothing after it, it writes a plausible request (the "Magpie" technique, Xu et al. 2024). Sampled
many times, those turns are a prompt set drawn from the model's own tuning data, and its replies to them
are the distribution a drafter must learn. No dataset is needed, for any target with a chat template.

Each sampled turn is a candidate with an index. Its tokens are a function of (seed, index, position) and
the target alone: every token is drawn by inverse CDF from the temperature/top-p distribution with one
uniform number made from those three, so candidates come out the same in any batch, in any order, through
the batched generator (train/batched.py) or transformers' `generate` (a logits processor that makes the
drawn token the greedy one). The set is the first N candidates, in index order, that pass the cheap
checks of train/prompts/quality.py (ended within the token limit, length, script, not a near-duplicate of
an earlier one). Candidates are appended to `<folder>/self-prompts/candidates.jsonl` as they finish, with
the settings that made them beside them, so an interrupted run resumes and a seed rebuilds the same set.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from dflash_cli.engine.errors import InvalidSettingError
from dflash_cli.engine.target import Target
from dflash_cli.train.prompts.quality import NearDuplicates, PromptStats, category, prompt_stats, rejection

FOLDER = "self-prompts"
# Chosen by benchmarks/self_prompts.py on SmolLM2-135M-Instruct (docs/training.md, "Prompts the target writes")
TEMPERATURE, TOP_P = 1.0, 0.95
MAX_PROMPT_TOKENS = 160
NUCLEUS_WITHIN = (256, 4096)  # top-k sizes tried for the top-p nucleus before a full sort
# candidates sampled at most per prompt asked for (and a few more): a target that repeats itself this much is
# told so instead of sampling forever
MAX_TRIES_PER_PROMPT = 8
_SENTINEL = "\ue000"


@dataclass(frozen=True)
class SelfPromptSettings:
    seed: int = 0
    temperature: float = TEMPERATURE
    top_p: float = TOP_P
    max_tokens: int = MAX_PROMPT_TOKENS


@dataclass(frozen=True)
class UserTurn:
    """Where a user's text starts in the target's chat template, and what ends it."""

    header: list[int]  # the template's tokens up to the user's text (a default system turn included)
    stop_ids: list[int]  # tokens that end the turn: the template's closing control token, the end-of-text ids
    end_texts: list[str]  # texts that end the turn in decoded output: the control tokens' and the closing text


def user_turn(tokenizer: Any, stop_ids: Sequence[int] = ()) -> UserTurn:
    """The opening of a lone user turn as the target's template renders it (with the system turn it adds by
    itself, if any), and the ids and texts that close it."""
    from dflash_cli.engine.text import added_tokens, chat_template_of

    if not chat_template_of(tokenizer):
        raise InvalidSettingError("self prompts need a chat template, and this target has none",
                                  hint="a base model does not write user turns: use its instruct model, or give "
                                       "--prompts a file or a built-in set (mix, wide)")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False,
                                             add_generation_prompt=False)
    if not isinstance(rendered, str) or _SENTINEL not in rendered:
        raise InvalidSettingError("the target's chat template does not show where a user's text goes",
                                  hint="give --prompts a file or a built-in set (mix, wide)")
    head, _, tail = rendered.partition(_SENTINEL)
    header = list(tokenizer.encode(head, add_special_tokens=False))
    specials = {t.content: i for i, t in added_tokens(tokenizer).items() if t.special and t.content}
    closing = tail.strip()
    stops = list(dict.fromkeys([*(int(i) for i in stop_ids),
                                *(i for text, i in specials.items() if closing.startswith(text))]))
    ends = sorted({*specials, *([closing.split()[0]] if closing and closing.split()[0] not in specials else [])},
                  key=len, reverse=True)
    return UserTurn(header, stops, ends)


def uniform(seed: int, index: int, position: int) -> float:
    """A number in [0, 1) from (seed, candidate index, position) alone (splitmix64 of their mix)."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + position * 0x94D049BB133111EB) & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return ((x ^ (x >> 31)) >> 11) / float(1 << 53)


def draw_tokens(settings: SelfPromptSettings, keys: Sequence[int], positions: torch.Tensor,
                scores: torch.Tensor) -> torch.Tensor:
    """Row r's token from its fp32 logits `scores[r]`: the inverse CDF of the temperature/top-p distribution at
    uniform(seed, keys[r], positions[r]), over the tokens by falling probability."""
    probs = torch.softmax(scores / settings.temperature, dim=-1)
    u = torch.tensor([uniform(settings.seed, int(k), int(p)) for k, p in zip(keys, positions.tolist())],
                     device=scores.device)
    if settings.top_p >= 1.0:
        return _inverse_cdf(probs, u)
    # the nucleus usually lies within the most likely 256 tokens (68% of SmolLM2's rows at T=1), nearly always
    # within 4096 (99%): a full sort of the vocabulary (20x slower than a top-256 at 128 rows) for the rest only
    tokens = torch.empty(len(u), dtype=torch.long, device=scores.device)
    rows = torch.arange(len(u), device=scores.device)
    vocab = probs.shape[-1]
    for within in (*(k for k in NUCLEUS_WITHIN if k < vocab), vocab):
        ordered, order = (probs[rows].topk(within, dim=-1) if within < vocab
                          else probs[rows].sort(dim=-1, descending=True))
        # the nucleus ends before the last of these tokens (all of the vocabulary: it always does)
        covered = (ordered.sum(-1) - ordered[:, -1] >= settings.top_p) | (within == vocab)
        at = _inverse_cdf(_nucleus(ordered[covered], settings.top_p), u[rows[covered]])
        tokens[rows[covered]] = order[covered].gather(1, at[:, None])[:, 0]
        rows = rows[~covered]
        if not len(rows):
            break
    return tokens


def _nucleus(ordered: torch.Tensor, top_p: float) -> torch.Tensor:
    """Probabilities by falling value, those after the smallest prefix whose mass reaches top_p set to 0."""
    return ordered.masked_fill(ordered.cumsum(-1) - ordered >= top_p, 0.0)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row r's index where the cumulative weight first passes u[r] of its total (weights >= 0, not normalized)."""
    cdf = weights.cumsum(-1)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None].contiguous(), right=True)[:, 0]
    return picked.clamp_(max=weights.shape[-1] - 1)


# -- sampling candidates ----------------------------------------------------------------------------------

def write_candidates(target: Target, turn: UserTurn, indices: Sequence[int], settings: SelfPromptSettings, *,
                     width: int | None = None) -> Iterator[tuple[int, list[int], bool]]:
    """(index, the turn's tokens, whether a stop id ended it) for each candidate index, as they finish."""
    from dflash_cli.train.batched import DEFAULT_WIDTH, batched_generator

    stops = set(turn.stop_ids)
    gen = batched_generator(target, [0], [turn.header], max_new_tokens=settings.max_tokens, stop_ids=turn.stop_ids,
                            width=width or DEFAULT_WIDTH, choose=partial(draw_tokens, settings)) if indices else None
    if gen is not None:
        for i, example in gen.answers((i, turn.header) for i in indices):
            tokens = example.ids[example.prompt_len :].tolist()
            yield i, tokens, bool(tokens) and tokens[-1] in stops
        return
    batch = width or 16
    for start in range(0, len(indices), batch):
        chunk = list(indices[start : start + batch])
        for i, tokens in zip(chunk, _generate_turns(target, turn, chunk, settings)):
            yield i, tokens, bool(tokens) and tokens[-1] in stops


@torch.inference_mode()
def _generate_turns(target: Target, turn: UserTurn, keys: list[int], settings: SelfPromptSettings) -> list[list[int]]:
    """The turns of candidates `keys` through transformers' generate (every row the same header: no padding)."""
    from transformers import LogitsProcessorList

    width = len(turn.header)

    def force_drawn(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        positions = torch.full((len(keys),), input_ids.shape[1], dtype=torch.long)
        tokens = draw_tokens(settings, keys, positions, scores.float())
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(1, tokens[:, None].to(scores.device), 0.0)

    ids = torch.tensor([turn.header] * len(keys), device=target.device)
    pad = turn.stop_ids[0] if turn.stop_ids else 0
    out = target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=settings.max_tokens, eos_token_id=turn.stop_ids or None,
                                pad_token_id=pad, temperature=None, top_p=None, top_k=None,
                                logits_processor=LogitsProcessorList([force_drawn]))
    stops = set(turn.stop_ids)
    turns = []
    for row in out[:, width:].tolist():
        end = next((k + 1 for k, t in enumerate(row) if t in stops), len(row))
        turns.append(row[:end])
    return turns


# -- the stored candidates --------------------------------------------------------------------------------

@dataclass
class Candidate:
    text: str
    ended: bool


class CandidateStore:
    """`<folder>/self-prompts/`: settings.json (what made the candidates) and candidates.jsonl (one line each,
    appended as they finish; a line cut off by an interrupted run is dropped when read)."""

    def __init__(self, folder: Path, record: dict[str, Any]):
        self.dir = Path(folder) / FOLDER
        self.dir.mkdir(parents=True, exist_ok=True)
        settings = self.dir / "settings.json"
        if settings.exists():
            stored = json.loads(settings.read_text())
            if stored != record:
                changed = ", ".join(k for k in sorted(set(stored) | set(record)) if stored.get(k) != record.get(k))
                raise InvalidSettingError(
                    f"{self.dir} holds prompts sampled with other settings ({changed})",
                    hint="train with the settings of the earlier runs, or use another output folder")
        else:
            tmp = settings.with_suffix(".tmp")
            tmp.write_text(json.dumps(record, indent=1))
            tmp.replace(settings)
        self.path = self.dir / "candidates.jsonl"
        self.candidates: dict[int, Candidate] = {}
        if self.path.exists():
            self._read()

    def _read(self) -> None:
        good = 0
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    break  # the last line of an interrupted run
                if not line.endswith("\n"):
                    break
                self.candidates[int(row["i"])] = Candidate(row["text"], bool(row["ended"]))
                good += len(line.encode("utf-8"))
        if good != self.path.stat().st_size:
            with open(self.path, "r+b") as f:
                f.truncate(good)

    def add(self, index: int, candidate: Candidate) -> None:
        self.candidates[index] = candidate
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"i": index, "text": candidate.text, "ended": candidate.ended}) + "\n")

    def write_summary(self, stats: PromptStats) -> None:
        (self.dir / "summary.json").write_text(json.dumps(asdict(stats), indent=1))


@dataclass
class Selection:
    prompts: list[str]
    indices: list[int]  # each prompt's candidate index
    scanned: int  # candidates 0..scanned-1 were looked at (all of them stored)
    rejected: Counter[str]


def select(candidates: dict[int, Candidate], n: int) -> Selection:
    """The first n candidates, in index order, that pass the checks and repeat no earlier kept one."""
    seen = NearDuplicates()
    prompts: list[str] = []
    indices: list[int] = []
    rejected: Counter[str] = Counter()
    i = 0
    while len(prompts) < n and i in candidates:
        text = candidates[i].text
        reason = rejection(text, candidates[i].ended) or (None if seen.add(text) else "duplicate")
        if reason is None:
            prompts.append(text)
            indices.append(i)
        else:
            rejected[reason] += 1
        i += 1
    return Selection(prompts, indices, i, rejected)


def turn_text(tokenizer: Any, turn: UserTurn, tokens: list[int]) -> tuple[str, bool]:
    """A sampled turn's text, cut where the template's closing text or a control token starts, and whether
    one did (the turn ended in text rather than at a stop id)."""
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    cut = min((k for k in (text.find(e) for e in turn.end_texts) if k >= 0), default=-1)
    return (text[:cut].strip(), True) if cut >= 0 else (text.strip(), False)


def candidate(tokenizer: Any, turn: UserTurn, tokens: list[int], stopped: bool) -> Candidate:
    """A sampled turn (`stopped`: its last token is a stop id) as it is stored."""
    text, closed = turn_text(tokenizer, turn, tokens[:-1] if stopped else tokens)
    return Candidate(text, stopped or closed)


@dataclass
class SelfPrompts:
    prompts: list[str]
    categories: list[str]
    stats: PromptStats
    sampled: int  # candidates sampled in this run


ProgressFn = Callable[[dict[str, Any]], None]


def sample_self_prompts(target: Target, tokenizer: Any, n: int, folder: Path, settings: SelfPromptSettings, *,
                        stop_ids: Sequence[int] = (), width: int | None = None,
                        on_progress: ProgressFn | None = None) -> SelfPrompts:
    """N prompts the target writes itself, sampled into (or read back from) `folder`/self-prompts."""
    turn = user_turn(tokenizer, stop_ids)
    store = CandidateStore(folder, {**asdict(settings), "target": target.name, "header": turn.header})
    limit = MAX_TRIES_PER_PROMPT * n + 64
    sampled = 0
    while True:
        chosen = select(store.candidates, n)
        if len(chosen.prompts) == n:
            break
        if chosen.scanned >= limit:
            raise InvalidSettingError(
                f"the target wrote only {len(chosen.prompts)} usable, distinct prompts in {chosen.scanned} tries "
                f"({_reasons(chosen.rejected)})", hint=f"ask for fewer (self:{len(chosen.prompts)}), or join "
                                                      "self with a built-in set (self:N+wide)")
        # enough candidates for the prompts still missing at the share kept so far (a guess before there is one)
        rate = len(chosen.prompts) / chosen.scanned if chosen.scanned >= 32 else 0.8
        upto = min(limit, chosen.scanned + math.ceil((n - len(chosen.prompts)) / max(rate, 0.05) * 1.05) + 8)
        todo = [i for i in range(chosen.scanned, upto) if i not in store.candidates]
        started, tokens, this_round = time.perf_counter(), 0, 0
        for i, ids, ended in write_candidates(target, turn, todo, settings, width=width):
            store.add(i, candidate(tokenizer, turn, ids, ended))
            this_round, tokens = this_round + 1, tokens + len(ids)
            if on_progress and (this_round % 64 == 0 or this_round == len(todo)):
                on_progress(dict(sampled=len(store.candidates), upto=upto, wanted=n, tokens=tokens,
                                 seconds=time.perf_counter() - started))
        sampled += this_round
    stats = prompt_stats(chosen.prompts, dict(chosen.rejected))
    store.write_summary(stats)
    return SelfPrompts(chosen.prompts, [category(p) for p in chosen.prompts], stats, sampled)


def summary_line(result: SelfPrompts, folder: Path) -> str:
    """What `train` says once the self prompts are ready."""
    stats = result.stats
    tried = stats.count + sum(stats.rejected.values())
    mix = ", ".join(f"{name} {100 * share:.0f}%" for name, share in stats.categories.items())
    return (f"self:{stats.count}: prompts the target wrote, kept from {tried} samples "
            f"({_reasons(Counter(stats.rejected)) if stats.rejected else 'none rejected'}; {result.sampled} sampled "
            f"in this run); {mix}; {stats.words_median:.0f} words median; in {Path(folder) / FOLDER}")


def _reasons(rejected: Counter[str]) -> str:
    return ", ".join(f"{count} {reason}" for reason, count in rejected.most_common()) or "none rejected"
