"""The only engine objects the UI sees: one Step per verify round, with cumulative statistics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

FINISH_STOP = "stop"  # a stop token was generated
FINISH_LENGTH = "length"  # max_new_tokens was reached
FINISH_CONTEXT = "context"  # the context (max_context, or the target's own limit) filled up first


@dataclass(frozen=True)
class GenerationStats:
    """Counters and timings of one generation so far (docs/format.md section 6 defines them)."""

    prompt_tokens: int
    prefilled_tokens: int  # prompt tokens actually run through the target (fewer when a cache was reused)
    prefill_seconds: float  # also the time to first token: the first token comes from the prefill logits
    generated_tokens: int
    decode_seconds: float  # wall time of the verify steps, excluding the prefill and the caller's own time
    steps: int  # target forwards after the prefill
    drafted: int
    accepted: int
    draft_seconds: float
    verify_seconds: float
    block_size: int  # 1 when decoding without a drafter
    committed_histogram: tuple[int, ...]  # [k] = steps that committed k+1 tokens
    position_drafted: tuple[int, ...]  # [k] = steps whose block had a draft at position k+1
    position_accepted: tuple[int, ...]  # [k] = steps that accepted the draft at position k+1
    peak_memory_bytes: int | None
    peak_memory_kind: str
    adaptive: bool = False  # block sizes chosen per round (see engine/adaptive.py)
    block_rounds: tuple[int, ...] = ()  # [n-1] = rounds run with n slots (1 = drafting paused)
    last_block: int = 0  # slots of the latest round: the current adaptive choice
    threads: int = 0  # CPU threads of the latest round (engine/cpu/threads.py); 0: not chosen here (a GPU, a server)
    thread_changes: int = 0  # times the thread count changed during this generation (a core taken or freed)
    pause_reason: str = ""  # adaptive runs that paused drafting: why, at the latest pause (engine/adaptive.py)
    draft_window: int = 0  # the drafter's context window in tokens (--draft-window); 0: the whole context
    finish_reason: str | None = None
    # a remote engine (runtime/remote.py): whether it reported speculative counters, and the tokens it streamed
    # after the first (it reports no per-step histogram to count them from)
    acceptance_reported: bool = True
    counted_decode_tokens: int | None = None

    @property
    def speculative(self) -> bool:
        return self.block_size > 1

    @property
    def time_to_first_token(self) -> float:
        return self.prefill_seconds

    @property
    def decode_tokens(self) -> int:
        """Tokens committed by verify steps (the first token comes from the prefill)."""
        if self.counted_decode_tokens is not None:
            return self.counted_decode_tokens
        return sum((k + 1) * n for k, n in enumerate(self.committed_histogram))

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def acceptance_length(self) -> float:
        """tau: mean tokens committed per verify step, bonus token included (1..B)."""
        return self.decode_tokens / self.steps if self.steps else 0.0

    @property
    def draft_acceptance(self) -> float:
        """Accepted drafts / drafted tokens: a different, smaller number than tau."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def per_position_acceptance(self) -> tuple[float, ...]:
        """[k] = share of steps drafting position k+1 that accepted it."""
        return tuple(a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted))

    def to_dict(self) -> dict:
        data = asdict(self)
        for name in ("speculative", "time_to_first_token", "decode_tokens", "decode_tokens_per_second",
                     "acceptance_length", "draft_acceptance", "per_position_acceptance"):
            value = getattr(self, name)
            data[name] = list(value) if isinstance(value, tuple) else value
        for name in ("committed_histogram", "position_drafted", "position_accepted", "block_rounds"):
            data[name] = list(data[name])
        return data


@dataclass(frozen=True)
class Step:
    """What one verify round (or the prefill, for the first token) committed."""

    tokens: tuple[int, ...]
    text: str  # newly printable text; may be empty while a multi-byte character is incomplete
    pieces: tuple[str, ...]  # `text` split per token, aligned with `tokens` and `from_draft`
    drafted: int
    accepted: int
    from_draft: tuple[bool, ...]  # per token: proposed by the drafter (True) or chosen by the target
    draft_seconds: float
    verify_seconds: float
    stats: GenerationStats  # cumulative, so the latest Step always has the figures so far
    finish_reason: str | None = None  # set on the last Step only


@dataclass(frozen=True)
class GenerationResult:
    tokens: list[int]
    text: str
    stats: GenerationStats


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where two token sequences differ (a length difference counts), None if identical."""
    index = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if index is None and len(a) != len(b):
        index = min(len(a), len(b))
    return index
