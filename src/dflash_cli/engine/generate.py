"""stream_generate: rounds -> Steps with text, stops, limits and statistics; generate joins them."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from dflash_cli.engine.adaptive import BlockSizeController
from dflash_cli.engine.baseline import baseline_rounds
from dflash_cli.engine.constraint import constrained_sampler
from dflash_cli.engine.cpu.threads import ThreadGovernor
from dflash_cli.engine.device import peak_memory, reset_peak_memory
from dflash_cli.engine.drafter import Drafter
from dflash_cli.engine.errors import InvalidSettingError
from dflash_cli.engine.hf_config import check_block_size
from dflash_cli.engine.output_format import OutputFormat
from dflash_cli.engine.response import (
    FINISH_CONTEXT,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationResult,
    GenerationStats,
    Step,
)
from dflash_cli.engine.sampling import Sampler
from dflash_cli.engine.speculative import Round, read_context, speculative_rounds
from dflash_cli.engine.state import DecodeState
from dflash_cli.engine.target import Target


def default_stop_ids(target: Target, tokenizer: Any = None) -> list[int]:
    """The target's end-of-generation ids: generation_config.eos_token_id (an int or a list), else the tokenizer's."""
    ids: list[int] = []
    gen = getattr(target.model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is None:
        eos = getattr(target.config, "eos_token_id", None)
    if eos is not None:
        ids.extend(eos if isinstance(eos, (list, tuple)) else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return [int(i) for i in ids]


def resolve_block_size(drafter: Drafter | None, block_size: int | None) -> int:
    """The block length to use: the drafter's trained size unless overridden with 1..trained (1 = no drafting)."""
    check_block_size(block_size, drafter.block_size if drafter is not None else None)
    if drafter is None:
        return 1
    return drafter.block_size if block_size is None else block_size


class _Tally:
    """Mutable counters behind the frozen GenerationStats snapshots."""

    def __init__(self, prompt_tokens: int, prefilled: int, block_size: int, device: torch.device,
                 adaptive: bool = False, threads: ThreadGovernor | None = None):
        self.prompt_tokens, self.prefilled, self.block_size, self.device = prompt_tokens, prefilled, block_size, device
        self.adaptive = adaptive
        self.threads = threads
        self.threads_before = threads.changes if threads is not None else 0
        self.block_rounds = [0] * block_size  # [n-1] = rounds run with n slots
        self.pause_reason = ""
        self.draft_window = 0
        self.last_block = 0
        self.prefill_seconds = self.decode_seconds = self.draft_seconds = self.verify_seconds = 0.0
        self.generated = self.steps = self.drafted = self.accepted = 0
        self.histogram = [0] * block_size
        self.pos_drafted = [0] * max(block_size - 1, 0)
        self.pos_accepted = [0] * max(block_size - 1, 0)

    def add_round(self, r: Round, committed: int, controller: BlockSizeController | None = None) -> None:
        if controller is not None and r.drafted == 0:
            self.pause_reason = controller.pause_reason or self.pause_reason
        self.steps += 1
        self.generated += committed
        self.drafted += r.drafted
        self.accepted += min(r.accepted, committed)
        self.histogram[committed - 1] += 1
        self.block_rounds[r.drafted] += 1
        self.last_block = r.drafted + 1
        for k in range(r.drafted):
            self.pos_drafted[k] += 1
        for k in range(min(r.accepted, committed)):
            self.pos_accepted[k] += 1
        self.draft_seconds += r.draft_seconds
        self.verify_seconds += r.verify_seconds
        self.decode_seconds += r.wall_seconds

    def snapshot(self, finish_reason: str | None = None) -> GenerationStats:
        memory = peak_memory(self.device)
        return GenerationStats(
            prompt_tokens=self.prompt_tokens, prefilled_tokens=self.prefilled,
            prefill_seconds=self.prefill_seconds, generated_tokens=self.generated,
            decode_seconds=self.decode_seconds, steps=self.steps, drafted=self.drafted, accepted=self.accepted,
            draft_seconds=self.draft_seconds, verify_seconds=self.verify_seconds, block_size=self.block_size,
            committed_histogram=tuple(self.histogram), position_drafted=tuple(self.pos_drafted),
            position_accepted=tuple(self.pos_accepted), peak_memory_bytes=memory.peak_bytes,
            peak_memory_kind=memory.kind, adaptive=self.adaptive, block_rounds=tuple(self.block_rounds),
            last_block=self.last_block, threads=self.threads.threads if self.threads is not None else 0,
            thread_changes=self.threads.changes - self.threads_before if self.threads is not None else 0,
            pause_reason=self.pause_reason if self.block_rounds and self.block_rounds[0] else "",
            draft_window=self.draft_window, finish_reason=finish_reason)


def stream_generate(target: Target, drafter: Drafter | None, prompt: Sequence[int], *,
                    tokenizer: Any = None, max_new_tokens: int = 256, temperature: float = 0.0,
                    top_p: float = 1.0, top_k: int = 0, seed: int | None = None, block_size: int | None = None,
                    stop_ids: Sequence[int] | None = None, state: DecodeState | None = None,
                    max_context: int | None = None, adaptive: bool | None = None,
                    controller: BlockSizeController | None = None,
                    output_format: OutputFormat | None = None) -> Iterator[Step]:
    """Generates from `prompt` (token ids), yielding one Step per target forward.

    Args:
        target: the loaded target.
        drafter: a drafter attached to `target` (load_pair does that), or None for plain decoding.
        prompt: prompt token ids (chat template already applied).
        tokenizer: used only to turn tokens into text; without it Step.text is "".
        max_new_tokens: hard limit on generated tokens, honoured exactly (default 256).
        temperature, top_p, top_k: 0 = greedy (default); otherwise sampling, lossless in distribution.
        seed: makes sampling reproducible.
        block_size: tokens per verify step, anchor included; default the drafter's trained size.
        adaptive: choose the block size each round from measured acceptance and costs (down to pausing
            drafting when it does not pay); default on unless block_size is given.
        controller: the BlockSizeController to use; default the one `state` keeps (what it learned carries
            across the turns of a chat).
        stop_ids: generation ends after any of these; default the target's eos ids.
        state: a DecodeState from an earlier call (a chat): the shared prefix of its tokens is not re-read.
        max_context: most tokens (prompt + reply) to hold; default the target's context length.
        output_format: a JSON schema, grammar or regex every token keeps to, drafts included
            (engine/constraint.py); the reply ends with a stop id once it is complete.
    Yields:
        Step objects; the last has finish_reason set. Leaving the loop early (break, Ctrl-C) leaves
        `state` consistent and reusable.
    """
    _check_request(target, prompt, max_new_tokens)
    block = resolve_block_size(drafter, block_size)
    stops = set(default_stop_ids(target, tokenizer) if stop_ids is None else stop_ids)
    sample = _sampler(target, tokenizer, Sampler(temperature, top_p, top_k, seed), output_format, stops)
    limit, at_limit = _limit(target, len(prompt), max_new_tokens, max_context)  # before a state takes the caches
    if state is None or state.drafter is not drafter or state.target is not target:
        state = DecodeState(target, drafter)
    controller = _block_controller(state, block, block_size is None if adaptive is None else adaptive, controller)
    decoder = _stream_decoder(tokenizer)
    reset_peak_memory(target.device)
    threads = target.threads
    try:
        t0 = time.perf_counter()
        if threads is not None:
            threads.check(force=True)  # the window since the last reply (or the load) says what is free now
        first_id, reused = _read_prompt(state, sample, list(prompt), drafter if block > 1 else None)
        tally = _Tally(len(prompt), len(prompt) - reused, block, target.device, adaptive=controller is not None,
                       threads=threads)
        tally.prefill_seconds = time.perf_counter() - t0
        tally.draft_window = (getattr(drafter, "context_window", None) or 0) if block > 1 else 0
        tally.generated = 1

        finish = _finish_reason(first_id, stops, len(state.tokens), limit, at_limit)
        pieces = _pieces(decoder, first_id, finish)
        yield Step(tuple(first_id), "".join(pieces), pieces, 0, 0, (False,), 0.0, 0.0, tally.snapshot(finish),
                   finish)
        if finish:
            return

        # block > 1 only with a drafter (resolve_block_size)
        rounds = (speculative_rounds(state, drafter, sample, block_size=block, limit=limit, controller=controller)
                  if block > 1 and drafter is not None else baseline_rounds(state, sample, limit=limit))
        for r in rounds:
            tokens = _cut_at_stop(state, r.tokens, stops)
            tally.add_round(r, len(tokens), controller)
            finish = _finish_reason(tokens, stops, len(state.tokens), limit, at_limit)
            pieces = _pieces(decoder, tokens, finish)
            accepted = min(r.accepted, len(tokens))
            from_draft = tuple([True] * accepted + [False] * (len(tokens) - accepted))
            yield Step(tuple(tokens), "".join(pieces), pieces, r.drafted, accepted, from_draft,
                       r.draft_seconds, r.verify_seconds, tally.snapshot(finish), finish)
            if finish:
                return
            if threads is not None:
                threads.check()  # before the next round: another process may have taken a core, or left one
    finally:
        state.repair()


def _read_prompt(state: DecodeState, sample: Sampler, prompt: list[int],
                 drafter: Drafter | None) -> tuple[list[int], int]:
    """Prefills `prompt` (the drafter too, when one will draft) and commits the first token: (its id in a list,
    how many prompt tokens the caches already held)."""
    logits, reused = state.prefill(prompt)
    first = sample(logits, len(prompt))  # (1,) the token at position len(prompt)
    state.commit(first_id := first.tolist(), None, anchor=first)
    sample.advance(first_id)
    if drafter is not None:
        read_context(state, drafter)
    return first_id, reused


def _sampler(target: Target, tokenizer: Any, sampler: Sampler, output_format: OutputFormat | None,
             stops: set[int]) -> Sampler:
    """`sampler`, or the one that keeps to `output_format` (its grammar ends on the stop ids)."""
    vocab = max(target.vocab_rows, len(tokenizer) if tokenizer is not None else 0)
    return constrained_sampler(sampler, output_format, tokenizer, vocab, sorted(stops))


def _stream_decoder(tokenizer: Any) -> Any:
    """The detokenizer of the Steps' text, or None without a tokenizer (Step.text is then "")."""
    if tokenizer is None:
        return None
    from dflash_cli.engine.text import StreamDecoder

    return StreamDecoder(tokenizer)


def _cut_at_stop(state: DecodeState, tokens: list[int], stops: set[int]) -> list[int]:
    """A round's tokens up to its first stop id: the ones after it are rolled back out of `state`."""
    stop_at = next((i for i, t in enumerate(tokens) if t in stops), None)
    if stop_at is None or stop_at + 1 == len(tokens):
        return tokens
    state.rewind(len(state.tokens) - (len(tokens) - stop_at - 1))
    return tokens[: stop_at + 1]


def _check_request(target: Target, prompt: Sequence[int], max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise InvalidSettingError(f"max new tokens must be >= 1, got {max_new_tokens}")
    if not prompt:
        raise InvalidSettingError("the prompt is empty")
    bad = [t for t in prompt if not 0 <= t < target.vocab_rows]
    if bad:
        raise InvalidSettingError(f"prompt token id {bad[0]} is outside the target's vocabulary")


def _block_controller(state: DecodeState, block: int, adaptive: bool,
                      controller: BlockSizeController | None) -> BlockSizeController | None:
    """The controller that chooses each round's block (the caller's, or the one the state keeps across
    calls); None for fixed blocks and plain decoding. The one place that says "adaptive unless a block size
    is given"."""
    if not adaptive or block == 1:
        return None
    return controller if controller is not None else state.block_controller(block)


def _limit(target: Target, prompt_len: int, max_new_tokens: int, max_context: int | None) -> tuple[int, str]:
    """(most tokens the sequence may reach, the finish reason when it does): the reply's budget, or the
    context when that is smaller; a prompt that fills the context is an error."""
    limit = prompt_len + max_new_tokens
    context = min((c for c in (target.context_limit, max_context) if c), default=None)
    if not context:
        return limit, FINISH_LENGTH
    at_limit = FINISH_CONTEXT if context < limit else FINISH_LENGTH
    limit = min(limit, context)
    if prompt_len >= limit:
        raise InvalidSettingError(f"the prompt has {prompt_len} tokens, the context holds {context}",
                                  hint="shorten the prompt, /clear the chat, or raise --max-context")
    return limit, at_limit


def _pieces(decoder, tokens: list[int], finish: str | None) -> tuple[str, ...]:
    """Printable text per token (held-back bytes show up with a later token); flushed at the end."""
    if decoder is None:
        return ("",) * len(tokens)
    pieces = [decoder.add([t]) for t in tokens]
    if finish:
        pieces[-1] += decoder.flush()
    return tuple(pieces)


def _finish_reason(tokens: Sequence[int], stops: set[int], length: int, limit: int, at_limit: str) -> str | None:
    if any(t in stops for t in tokens):
        return FINISH_STOP
    if length >= limit:
        return at_limit
    return None


def generate(target: Target, drafter: Drafter | None, prompt: Sequence[int], **kwargs: Any) -> GenerationResult:
    """Runs stream_generate to the end and returns the generated tokens, text and final statistics."""
    tokens: list[int] = []
    text: list[str] = []
    last: Step | None = None
    for last in stream_generate(target, drafter, prompt, **kwargs):
        tokens.extend(last.tokens)
        text.append(last.text)
    assert last is not None
    return GenerationResult(tokens, "".join(text), last.stats)


def warm_up(target: Target, drafter: Drafter | None, new_tokens: int | None = None) -> None:
    """Runs both loops briefly, so one-time kernel selection and allocation do not slow the first reply;
    `new_tokens` per loop (default two full blocks and a token)."""
    prompt = list(range(1, 17))
    block = drafter.block_size if drafter is not None else 1
    for d in ([drafter] if drafter is not None else []) + [None]:
        for _ in stream_generate(target, d, prompt, max_new_tokens=new_tokens or 2 * block + 2, stop_ids=[]):
            pass
