"""Training data on the fast path: many prompts answered at once through the forward decoding runs.

`generate_batch` (train/data.py) runs transformers' `generate` with forward hooks. On a Llama-style target
on a CPU this module runs the static-cache forward that decoding runs (engine/fast.py,
`FastPath.forward_rows`) with a batch dimension, in the fastest format measured for this CPU
(`choose_format`), and returns the same `Example`s: the ids, the tapped features of every fed token in
bf16, and optionally the top-k distribution at every response position.

Each batch row holds one sequence at its own positions (cache row == position, no padding): a prompt is
read alone into its row, in the pieces single-sequence decoding reads it in, and its answer's tokens are
then decoded one step at a time together with the other rows'. A row therefore computes what decoding that
prompt alone computes, up to the rounding of matmuls over more rows (fp32: ~1e-7, the greedy tokens equal
in the tests). A finished row leaves at once (the last row moves into its place, a copy of the rows its
sequence filled) and the next prompt takes a row, so every step runs full rows until the prompts run out.
The first prompt's K/V and features are kept in a spare row: a later prompt copies the part it shares with
it (a chat template's system prompt) instead of computing it again, as decoding reuses a cached prefix.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from dflash_cli.engine.hf_config import PREFILL_CHUNK
from dflash_cli.engine.state import common_prefix
from dflash_cli.engine.target import Target
from dflash_cli.train.example import Example

log = logging.getLogger(__name__)

# Prompts decoded together by default: the fastest width measured on SmolLM2-135M (benchmarks/bench_datagen.py,
# docs/training.md: 16, 32, 64, 128 rows gave 388, 473, 541, 569 tok/s on one AVX-512 core in bf16).
DEFAULT_WIDTH = 128
# Whether 4-bit weight-only linears beat packed bf16 at batch width where the CPU computes bf16 natively.
# Measured: they do not (317 against 541 tok/s at 64 rows), since a batch turns the memory-bound decode into
# compute-bound matmuls, where oneDNN's native bf16 beats PyTorch's int4 kernel.
Q4_PAYS_AT_WIDTH = False
# A row's cache, tokens and features take at most this share of the memory free at the start.
MEMORY_SHARE = 0.25


@dataclass(frozen=True)
class GenFormat:
    """How the target's linears run while generating: `dtype` activations (the target's own), `weights`
    "q4" (4-bit weight-only, engine/cpu/weightonly.py) or None (oneDNN-packed in `dtype` where it packs)."""

    dtype: torch.dtype
    weights: str | None
    why: str

    @property
    def name(self) -> str:
        return self.weights or str(self.dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace(
            "float32", "fp32")


def choose_format(target: Target, *, capability: str | None = None, fast_bf16: bool | None = None,
                  q4_pays: bool = Q4_PAYS_AT_WIDTH) -> GenFormat:
    """The format to generate in, from the target's dtype and what the CPU reports (engine/device.py).

    The dtype stays the target's (`train --dtype`; by default bf16 on CPUs that compute it natively, fp32
    elsewhere): fp32 data keep fp32's precision. A bf16 target runs q4 where torch's int4 kernel is vectorised
    and the CPU computes bf16 natively, if `q4_pays` (measured at batch width); a target loaded with --quant
    q4/q8 keeps that. (q4a8, decoding's choice on most CPUs, has no batched generator.)"""
    from dflash_cli.engine.device import cpu_capability, cpu_has_fast_bf16

    dtype = target.embed_weight.dtype
    if target.weight_quant:
        return GenFormat(dtype, target.weight_quant, f"the target was loaded with --quant {target.weight_quant}")
    if dtype != torch.bfloat16:
        return GenFormat(dtype, None, f"packed {str(dtype).removeprefix('torch.')}, the target's dtype")
    native = cpu_has_fast_bf16() if fast_bf16 is None else fast_bf16
    q4_runs = native and (capability or cpu_capability()) in ("AVX2", "AVX512")
    if q4_runs and q4_pays:
        return GenFormat(dtype, "q4", "4-bit weight-only linears: native bf16 here, and faster at batch width")
    return GenFormat(dtype, None, "packed bf16" + (" (native bf16 here)" if native else " (emulated here)")
                     + (": faster than q4 at batch width" if q4_runs else ""))


def named_format(target: Target, name: str) -> GenFormat:
    """`train --reply-format NAME`: the replies written in that format, which must suit the target's dtype
    (q4a8/q8a8 and fp32 read fp32 activations, bf16 and q4/q8 bf16 ones) and this CPU."""
    from dflash_cli.engine.errors import InvalidSettingError

    dtype = target.embed_weight.dtype
    wanted = torch.float32 if name in ("fp32", "q4a8", "q8a8") else torch.bfloat16
    if dtype != wanted:
        flag = "float32" if wanted == torch.float32 else "bfloat16"
        raise InvalidSettingError(f"--reply-format {name} needs the target in {flag}, and it is loaded in "
                                  f"{str(dtype).removeprefix('torch.')}", hint=f"add --dtype {flag}")
    if name in ("q4a8", "q8a8"):
        from dflash_cli.engine.cpu import native

        why = native.unavailable()
        if why is not None:
            raise InvalidSettingError(f"--reply-format {name} needs this project's AVX2 kernels: {why}")
    weights = None if name in ("fp32", "bf16") else name
    return GenFormat(dtype, weights, f"--reply-format {name}")


def unsupported(target: Target) -> str | None:
    """Why the batched generator cannot run `target` (train/data.py then uses transformers' generate)."""
    from dflash_cli.engine.fast_layers import FAMILIES, fast_path_unsupported

    model = target.model
    if target.device.type != "cpu":
        return f"batched generation runs on CPUs (the target is on {target.device.type})"
    if target.split or target.offloaded:
        return "layers on several devices"
    if getattr(model, "hf_quantizer", None) is not None or any(not p.is_floating_point() for p in model.parameters()):
        return "quantized weights (bitsandbytes)"
    reason = fast_path_unsupported(model)
    if reason is not None:
        return reason
    model_type = getattr(model.config, "model_type", None)
    if model_type not in FAMILIES:
        return f"model type {model_type!r} (batched generation: {', '.join(FAMILIES)})"
    return None


@dataclass
class _Row:
    key: Any  # the caller's name for the prompt
    prompt_len: int
    length: int  # tokens so far (prompt and answer); all but the last are in the cache
    done: bool = False


# picks each row's next token: (the rows' keys, the positions the tokens go to (rows,), fp32 logits (rows, V))
Choose = Callable[[list[Any], torch.Tensor, torch.Tensor], torch.Tensor]


class BatchedGenerator:
    """Greedy answers with the tapped features of every fed token, up to `width` sequences at a time.

    context: the longest prompt plus max_new_tokens (the cache's positions per row).
    choose: picks the tokens instead of greedy argmax (train/prompts/self_written.py samples prompts through it).
    """

    def __init__(self, target: Target, taps: Sequence[int], *, context: int, max_new_tokens: int,
                 stop_ids: Sequence[int] = (), topk: int = 0, width: int = DEFAULT_WIDTH,
                 fmt: GenFormat | None = None, choose: Choose | None = None):
        from dflash_cli.engine.fast import FastPath

        self.fmt = fmt or choose_format(target)
        assert self.fmt.dtype == target.embed_weight.dtype, (self.fmt, target.embed_weight.dtype)
        self.fast = FastPath(target.model, context, weights=self.fmt.weights, q4_codes=_q4_codes(target, self.fmt))
        self.fast.set_taps(list(taps))
        self.max_new, self.stops, self.topk, self.choose = max_new_tokens, set(stop_ids), topk, choose
        self.device = target.device
        features = len(taps) * target.hidden_size
        self.width = _fitting_width(self.fast, width, context, features, self.device)
        # batch row `width`: the first prompt, whose prefix later prompts copy (`reference`, its ids)
        self.cache = self.fast.new_cache(batch=self.width + 1)
        self.reference: list[int] = []
        self.ids = torch.zeros(self.width, context, dtype=torch.long, device=self.device)
        self.features = torch.zeros(self.width + 1, context, features, dtype=torch.bfloat16, device=self.device)
        self.top: tuple[torch.Tensor, torch.Tensor] | None = None
        if topk > 0:
            self.top = (torch.zeros(self.width, max_new_tokens, topk, dtype=torch.int32, device=self.device),
                        torch.zeros(self.width, max_new_tokens, topk, dtype=torch.float16, device=self.device))

    def answers(self, prompts: Iterable[tuple[Any, list[int]]],
                admit: Callable[[], bool] = lambda: True) -> Iterator[tuple[Any, Example]]:
        """(key, Example) for each (key, prompt ids), as they finish. `admit()` is asked before free rows take
        new prompts (once per step with free rows): False starts none, and those under way finish."""
        queue = iter(prompts)
        rows: list[_Row] = []
        while True:
            free = self.width - len(rows)
            new = list(islice(queue, free)) if free and admit() else []
            for key, prompt in new:
                rows.append(self._start(len(rows), key, prompt))
            yield from self._retire(rows)  # answers of one token
            if rows:
                self._step(rows)
                yield from self._retire(rows)
            elif not new:
                return

    def _start(self, r: int, key: Any, prompt: list[int]) -> _Row:
        """Reads `prompt` into batch row r (the part it shares with the reference prompt copied, the rest in
        decoding's pieces) and chooses its answer's first token."""
        n = len(prompt)
        if n == 0 or n + self.max_new > self.ids.shape[1]:
            raise ValueError(f"a prompt of {n} tokens and {self.max_new} new ones need {n + self.max_new} positions, "
                             f"the generator holds {self.ids.shape[1]}")
        shared = min(common_prefix(self.reference, prompt), n - 1)  # the last token's logits are computed
        self._copy_cache(self.width, r, shared)
        ids = torch.tensor(prompt, dtype=torch.long, device=self.device)
        self.ids[r, :n] = ids
        logits = None
        for at in range(shared, n, PREFILL_CHUNK):
            end = min(at + PREFILL_CHUNK, n)
            logits, hidden = self.fast.forward_rows(ids[None, at:end], torch.arange(at, end, device=self.device),
                                                    self.cache, slice(r, r + 1), taps=True, last_logit_only=True)
            assert hidden is not None
            self.features[r, at:end] = hidden[0].to(torch.bfloat16)
        assert logits is not None
        if not self.reference:
            self._copy_cache(r, self.width, n)
            self.reference = list(prompt)
        row = _Row(key, n, n)
        self._choose([row], torch.tensor([r], device=self.device), logits)
        return row

    def _step(self, rows: list[_Row]) -> None:
        """Feeds every row its newest token, at its own position, in one forward of all rows."""
        index = torch.arange(len(rows), device=self.device)
        at = torch.tensor([row.length - 1 for row in rows], device=self.device)
        logits, hidden = self.fast.forward_rows(self.ids[index, at][:, None], at[:, None], self.cache,
                                                slice(0, len(rows)), taps=True)
        assert hidden is not None
        self.features[index, at] = hidden[:, 0].to(torch.bfloat16)
        self._choose(rows, index, logits)

    def _choose(self, rows: list[_Row], index: torch.Tensor, logits: torch.Tensor) -> None:
        """Appends each row's next token (greedy, or `self.choose`'s) from its logits and the top-k table's row."""
        at = torch.tensor([row.length for row in rows], device=self.device)
        scores = logits.float()  # as generate scores; argmax over bf16 measured 4x slower than over fp32 on a CPU
        if self.choose is not None:
            tokens = self.choose([row.key for row in rows], at, scores)
        else:
            tokens = scores.argmax(-1)  # the first of equal maxima, as generate's greedy choice
        self.ids[index, at] = tokens
        if self.top is not None:
            top = torch.log_softmax(scores, dim=-1).topk(self.topk, dim=-1)
            answer_at = at - torch.tensor([row.prompt_len for row in rows], device=self.device)
            self.top[0][index, answer_at] = top.indices.to(torch.int32)
            self.top[1][index, answer_at] = top.values.to(torch.float16)
        for row, token in zip(rows, tokens.tolist()):
            row.length += 1
            row.done = token in self.stops or row.length - row.prompt_len >= self.max_new

    def _retire(self, rows: list[_Row]) -> Iterator[tuple[Any, Example]]:
        """The finished rows' examples; the last rows move into their places."""
        done = [i for i, row in enumerate(rows) if row.done]
        finished = [(rows[i].key, self._example(i, rows[i])) for i in done]
        for i in reversed(done):  # rows after i are unfinished by now: the last one fills the hole
            last = len(rows) - 1
            if i != last:
                self._move(last, i, rows[last].length)
                rows[i] = rows[last]
            rows.pop()
        yield from finished

    def _example(self, r: int, row: _Row) -> Example:
        n, answer = row.length, row.length - row.prompt_len
        example = Example(self.ids[r, :n].to("cpu", copy=True), self.features[r, :n - 1].to("cpu", copy=True),
                          row.prompt_len)
        if self.top is not None:
            example.top_ids = self.top[0][r, :answer].to("cpu", copy=True)
            example.top_logp = self.top[1][r, :answer].to("cpu", copy=True)
        return example

    def _move(self, src: int, dst: int, length: int) -> None:
        """Batch row src's sequence (`length` tokens) into row dst."""
        self._copy_cache(src, dst, length)
        self.ids[dst, :length] = self.ids[src, :length]
        if self.top is not None:
            for table in self.top:
                table[dst] = table[src]

    def _copy_cache(self, src: int, dst: int, length: int) -> None:
        """The K/V and features of positions < length from batch row src to row dst."""
        for buffer in self.cache.keys + self.cache.values:
            buffer[dst, :, :length].copy_(buffer[src, :, :length])
        self.features[dst, :length] = self.features[src, :length]


def _q4_codes(target: Target, fmt: GenFormat) -> dict | None:
    """The target folder's own 4-bit codes (a GGUF's, as `-m demo` decodes with) for a q4 or q4a8 format."""
    from dflash_cli.engine.cpu.weightonly import Q4_CODES_FILE, read_q4_codes

    if fmt.weights not in ("q4", "q4a8"):
        return None
    path = target.q4_codes_file or Path(target.name) / Q4_CODES_FILE
    return read_q4_codes(path) if Path(path).is_file() else None


def _fitting_width(fast: Any, width: int, context: int, features: int, device: torch.device) -> int:
    """`width`, or fewer rows where a row's cache, ids and features would not fit MEMORY_SHARE of the memory."""
    from dflash_cli.engine.device import free_memory

    itemsize = torch.empty((), dtype=fast.dtype).element_size()
    per_position = sum(2 * kv * hd * itemsize for kv, hd in fast.layer_shapes.values()) + 2 * features + 8
    free = free_memory(device)
    if free is None:
        return width
    return max(1, min(width, int(free * MEMORY_SHARE) // (per_position * (context + 2))))


def batched_generator(target: Target, taps: Sequence[int], prompts: Sequence[list[int]], *, max_new_tokens: int,
                      stop_ids: Sequence[int] = (), topk: int = 0, width: int = DEFAULT_WIDTH,
                      fmt: GenFormat | None = None, choose: Choose | None = None) -> BatchedGenerator | None:
    """A generator sized for these prompts, or None (said in the log) where only transformers' generate runs."""
    reason = unsupported(target)
    if reason is not None:
        log.info("training data through transformers' generate: %s", reason)
        return None
    context = max(map(len, prompts), default=1) + max_new_tokens
    return BatchedGenerator(target, taps, context=context, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                            topk=topk, width=width, fmt=fmt, choose=choose)


def generate_batched(target: Target, prompts_ids: list[list[int]], taps: Sequence[int], *, max_new_tokens: int,
                     stop_ids: Sequence[int] = (), topk: int = 0, width: int = DEFAULT_WIDTH,
                     fmt: GenFormat | None = None) -> list[Example]:
    """generate_batch's answers (in the prompts' order) from the batched generator; the target must be
    supported (`unsupported`)."""
    reason = unsupported(target)
    if reason is not None:
        raise ValueError(f"batched generation cannot run this target: {reason}")
    gen = batched_generator(target, taps, prompts_ids, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                            topk=topk, width=width, fmt=fmt)
    assert gen is not None
    found = dict(gen.answers(enumerate(prompts_ids)))
    return [found[i] for i in range(len(prompts_ids))]
