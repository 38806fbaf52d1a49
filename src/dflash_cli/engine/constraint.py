"""Structured output inside the decoding loop: a Sampler whose every choice is masked by a grammar.

`ConstrainedSampler` wraps the loop's Sampler and an llguidance matcher that has consumed every committed
token of the reply. Every row of logits it picks from is masked by the grammar state after the rows before
it, so:
- plain decoding (one row) masks by the committed state;
- the drafter's block (`__call__` on keep rows) is drafted inside the grammar: row i by the state advanced
  through drafts 1..i-1, on the matcher itself, rolled back afterwards;
- a verify (`verify`) masks row i by the state after the anchor and drafts 1..i, and stops at the first row
  whose choice differs from the next draft: exactly the rows the acceptance rule reads.
Each committed token was thus chosen from the same masked logits as plain constrained decoding would choose
it from, with the same position-keyed noise: greedy and seeded output stay identical (lossless).

Greedy rows skip the mask where they can: when the unmasked argmax is allowed it is the masked argmax (the
mask only removes tokens), and asking the matcher about one token is much cheaper than a full mask.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from dflash_cli.engine.errors import DFlashError
from dflash_cli.engine.output_format import OutputFormat, first_line, llguidance_module
from dflash_cli.engine.sampling import Sampler


class ConstraintError(DFlashError):
    """The grammar reached a state no token can leave (a bug in the grammar library or a tokenizer mismatch)."""


def allowed_from_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """(W,) int32 words, bit j of word i = token 32*i + j allowed -> (vocab,) bool."""
    bits = np.unpackbits(words.numpy().view(np.uint8), bitorder="little")[:vocab]
    return torch.from_numpy(bits.view(np.bool_))


@functools.lru_cache(maxsize=4)
def _lltokenizer(backend_json: str, vocab: int, eos: tuple[int, ...]) -> Any:
    ll = llguidance_module()
    try:
        return ll.LLTokenizer(backend_json, n_vocab=vocab, eos_token=list(eos))
    except ValueError as e:  # a tokenizer kind llguidance cannot read token bytes from (e.g. a word-level one)
        raise ConstraintError(f"structured output cannot use this model's tokenizer: {e}",
                              hint="byte-level BPE and SentencePiece tokenizers (Qwen, Llama, Gemma) work") from None


def grammar_tokenizer(tokenizer: Any, vocab: int, eos: Sequence[int]) -> Any:
    """llguidance's view of a Hugging Face fast tokenizer, over `vocab` logits with `eos` as its end tokens
    (the generation's stop ids); about a second to build for 150k tokens, so kept per tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ConstraintError("structured output needs a fast (Rust) tokenizer, and this model has a slow one",
                              hint="models with a tokenizer.json have one")
    key = getattr(tokenizer, "_dflash_backend_json", None)
    if key is None:
        from copy import copy

        backend = copy(backend)  # padding and truncation off, as llguidance.hf does
        backend.no_padding()
        backend.no_truncation()
        key = backend.to_str()
        tokenizer._dflash_backend_json = key
    return _lltokenizer(key, vocab, tuple(sorted(set(int(e) for e in eos))))


class ConstrainedSampler(Sampler):
    """A Sampler (the same seed, so the same noise) whose choices follow `fmt`'s grammar; see the module
    docstring. `sampler` picks from each masked row."""

    constrained = True

    def __init__(self, sampler: Sampler, fmt: OutputFormat, tokenizer: Any, vocab: int, eos: Sequence[int]):
        ll = llguidance_module()
        if not eos:
            raise ConstraintError("structured output needs an end-of-reply token, and this generation has none")
        self.sampler, self.format, self.vocab = sampler, fmt, vocab
        self.greedy, self.seed = sampler.greedy, sampler.seed
        self.temperature, self.top_p, self.top_k = sampler.temperature, sampler.top_p, sampler.top_k
        self.matcher = ll.LLMatcher(grammar_tokenizer(tokenizer, vocab, eos), fmt.grammar(), log_level=0)
        if self.matcher.is_error():
            raise ConstraintError(f"{fmt.describe()}: {first_line(self.matcher.get_error())}")
        self._words = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
        self._taken = 0  # drafted tokens consumed on top of the committed ones
        self.masks = self.checks = 0  # full masks computed, and single-token checks that replaced one

    @property
    def finished(self) -> bool:
        """The grammar is complete and takes nothing more (the reply ends here)."""
        return self.matcher.is_stopped()

    def __call__(self, logits: torch.Tensor, position: int = 0) -> torch.Tensor:
        """Picks row by row, each masked by the state after the picks before it (a drafted block)."""
        return self._pick(logits, position, follow=None)

    def verify(self, logits: torch.Tensor, position: int, drafts: torch.Tensor) -> torch.Tensor:
        """The target's choices for a verify block fed [anchor, drafts]: row i masked by the state after
        drafts[:i]; rows after the first choice that differs from its draft are not read (filled with it)."""
        return self._pick(logits, position, follow=drafts.tolist())

    def advance(self, tokens: Sequence[int]) -> None:
        """The committed tokens of a round, consumed for good."""
        for t in tokens:
            if self.matcher.is_stopped():
                return  # the end token after a complete grammar: nothing more to consume
            if not self.matcher.consume_token(int(t)):
                raise ConstraintError(f"{self.format.describe()}: token {t} was committed against the grammar "
                                      f"({first_line(self.matcher.get_error())})")

    def allowed(self, width: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """(width,) bool: the tokens the grammar allows next (ids past the tokenizer's are never allowed)."""
        allowed = self._allowed()[:width]
        if allowed.shape[0] < width:
            allowed = torch.cat([allowed, allowed.new_zeros(width - allowed.shape[0])])
        return allowed.to(device)

    def take(self, token: int) -> bool:
        """Advances the matcher by a drafted token until `rollback_taken`; False if the grammar refuses it."""
        # checked first: a refused token would leave the matcher in its error state for good
        if self.matcher.validate_tokens([int(token)]) != 1 or not self.matcher.consume_token(int(token)):
            return False
        self._taken += 1
        return True

    def rollback_taken(self) -> None:
        """Back to the committed state: undoes every `take` since the last rollback."""
        if self._taken:
            self.matcher.rollback(self._taken)
        self._taken = 0

    def _pick(self, logits: torch.Tensor, position: int, follow: list[int] | None) -> torch.Tensor:
        out: list[int] = []
        try:
            for i in range(logits.shape[0]):
                choice = self._choose(logits[i : i + 1], position + i)
                out.append(choice)
                if follow is not None and (i >= len(follow) or follow[i] != choice):
                    break  # the acceptance rule reads no row after this one
                if i + 1 < logits.shape[0] and not self.take(choice):
                    break  # an end token: the reply ends here, and the rows after it are cut away
        finally:
            self.rollback_taken()
        out += [out[-1]] * (logits.shape[0] - len(out))
        return torch.tensor(out, device=logits.device)

    def _choose(self, row: torch.Tensor, position: int) -> int:
        """One token from a (1, V) row, masked by the matcher's current state."""
        if self.greedy:
            best = int(row.float().argmax())
            if best < self.vocab and self.matcher.validate_tokens([best]) == 1:
                self.checks += 1
                return best
        allowed = self.allowed(row.shape[-1], row.device)
        masked = row.float().masked_fill(~allowed, float("-inf"))
        if not bool(allowed.any()):
            raise ConstraintError(f"{self.format.describe()}: no token can continue the output here",
                                  hint="the grammar may need a token the tokenizer cannot spell")
        if not bool(torch.isfinite(masked).any()):  # a draft vocabulary without any allowed token
            return int(allowed.nonzero()[0])
        return int(self.sampler(masked, position)[0])

    def _allowed(self) -> torch.Tensor:
        self.masks += 1
        words = self._words
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        return allowed_from_bitmask(words, self.vocab)


def constrained_sampler(sampler: Sampler, fmt: OutputFormat | None, tokenizer: Any, vocab: int,
                        eos: Sequence[int]) -> Sampler:
    """`sampler` itself without a format; else the sampler that keeps to it."""
    if fmt is None:
        return sampler
    if tokenizer is None:
        raise ConstraintError("structured output needs the model's tokenizer")
    return ConstrainedSampler(sampler, fmt, tokenizer, vocab, eos)
