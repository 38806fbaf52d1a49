"""Training data: the target answers prompts itself; token ids and tapped features are cached on disk.

Prompts are chat-templated and answered greedily in batches. Llama-style targets on a CPU run the batched
generator (train/batched.py: the fast path's static-cache forward with a batch dimension, each row its own
sequence); the others run transformers' `generate` (left padding), where forward hooks on the tapped decoder
layers capture their outputs during the same generate call, so no second pass is needed. With `topk` > 0
the target's k most likely tokens and their log-probabilities are also kept at every response position,
for distillation from the target's distribution rather than from its greedy token alone. Each batch of
answers becomes one safetensors shard (`ids.{i}`, `feat.{i}` in bf16, and `top_ids.{i}` int32 /
`top_logp.{i}` fp16 with top-k) and the JSON index records which prompts are done (and which generator
answered them): a re-run skips them and resumes where it stopped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dflash_cli.engine.errors import InvalidSettingError
from dflash_cli.engine.target import Target
from dflash_cli.train.example import Example

if TYPE_CHECKING:
    from dflash_cli.train.batched import BatchedGenerator

INDEX = "index.json"


def read_prompts(path: str | Path) -> list[str]:
    """One prompt per line, or a JSONL file of {"prompt": ...} objects (read as `bench` reads them, with
    errors naming the line); blank lines are skipped."""
    from dflash_cli.engine.errors import InvalidSettingError
    from dflash_cli.prompts.reader import parse_jsonl

    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InvalidSettingError(f"prompt file {path} is not UTF-8 text (byte {e.start})",
                                  hint="one prompt per line, or JSONL with a \"prompt\" field, in UTF-8") from None
    except OSError as e:
        raise InvalidSettingError(f"cannot read prompt file {path}: {e.strerror or e}") from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines and lines[0].startswith("{"):
        return [p.prompt for p in parse_jsonl(text, str(path), Path(path).stem)]
    return lines


def encode_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """A training prompt's tokens, as the generators read it (the target's chat template)."""
    from dflash_cli.engine.text import encode_prompt

    return encode_prompt(tokenizer, prompt)


class _TapRecorder:
    """Forward hooks that append each tapped layer's output on every forward of a generate call."""

    def __init__(self, target: Target, taps: Sequence[int]):
        self.taps = list(taps)
        self.chunks: dict[int, list[torch.Tensor]] = {t: [] for t in set(taps)}
        self.handles = []
        for t in set(taps):
            def hook(_m, _i, output, t=t):
                self.chunks[t].append(target.tapped(t, output).to(torch.bfloat16))
            self.handles.append(target.layers[t].register_forward_hook(hook))

    def features(self) -> torch.Tensor:
        """(batch, fed_tokens, n_taps*H) in the drafter's tap order."""
        return torch.cat([torch.cat(self.chunks[t], dim=1) for t in self.taps], dim=-1)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class _TopKRecorder:
    """A generate() logits processor that records the k most likely tokens of each step, changing nothing."""

    def __init__(self, k: int):
        self.k = k
        self.ids: list[torch.Tensor] = []
        self.logp: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        top = torch.log_softmax(scores.float(), dim=-1).topk(self.k, dim=-1)
        self.ids.append(top.indices.to(torch.int32).cpu())
        self.logp.append(top.values.to(torch.float16).cpu())
        return scores

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch, steps, k) ids and log-probs."""
        return torch.stack(self.ids, dim=1), torch.stack(self.logp, dim=1)


@torch.inference_mode()
def generate_batch(target: Target, prompts_ids: list[list[int]], taps: Sequence[int], *, max_new_tokens: int,
                   stop_ids: Sequence[int], pad_id: int, topk: int = 0) -> list[Example]:
    """Greedy answers for a batch of prompts (left padded) with the tapped features of every fed token
    (and the target's top-k distribution at every response position when `topk` > 0)."""
    from transformers import LogitsProcessorList

    width = max(map(len, prompts_ids))
    dev = target.device
    ids = torch.full((len(prompts_ids), width), pad_id, dtype=torch.long, device=dev)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts_ids):
        ids[i, width - len(p):] = torch.tensor(p, device=dev)
        attn[i, width - len(p):] = 1
    rec = _TapRecorder(target, taps)
    top = _TopKRecorder(topk) if topk > 0 else None
    try:
        out = target.model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens,
                                    do_sample=False, eos_token_id=list(stop_ids) or None, pad_token_id=pad_id,
                                    temperature=None, top_p=None, top_k=None,
                                    logits_processor=LogitsProcessorList([top] if top else []))
        feats = rec.features()
    finally:
        rec.remove()
    top_ids, top_logp = top.tables() if top else (None, None)
    stops = set(stop_ids)
    result = []
    for i, p in enumerate(prompts_ids):
        gen = out[i, width:].tolist()
        end = next((k + 1 for k, t in enumerate(gen) if t in stops), len(gen))
        seq = p + gen[:end]
        pad = width - len(p)
        f = feats[i, pad : pad + len(seq) - 1].cpu()
        assert f.shape[0] == len(seq) - 1, (f.shape, len(seq))
        example = Example(torch.tensor(seq), f.contiguous(), len(p))
        if top_ids is not None and top_logp is not None:
            example.top_ids, example.top_logp = top_ids[i, :end].contiguous(), top_logp[i, :end].contiguous()
        result.append(example)
    return result


def build_dataset(target: Target, tokenizer, prompts: Sequence[str], taps: Sequence[int], cache_dir: str | Path, *,
                  max_new_tokens: int = 200, batch_size: int | None = None, stop_ids: Sequence[int] = (),
                  on_progress: Callable[[int, int, int, float], None] | None = None,
                  time_budget: float | None = None, topk: int = 0, reply_format: str | None = None) -> list[int]:
    """Generates and stores answers for the prompts not yet in `cache_dir`; returns the indices done.

    Llama-style targets on a CPU answer through the batched generator (train/batched.py), the others
    through transformers' generate (`generate_batch`); both store the same shards.
    batch_size: prompts answered together, and per shard (default: batched.DEFAULT_WIDTH, or 16 through
    transformers' generate).
    time_budget: seconds; no new prompt starts after it is spent (those under way finish; the rest waits
    for a later run).
    topk: also store the target's k most likely tokens per response position (0 = none); a cache keeps
    the k it was started with.
    reply_format: the batched generator's format by name (batched.named_format); None: its own choice.

    on_progress(done_prompts, total_prompts, new_tokens, seconds) is called after each shard.
    """
    import time

    from dflash_cli.engine.errors import InvalidSettingError
    from dflash_cli.train.batched import DEFAULT_WIDTH, batched_generator, named_format, unsupported

    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    index, topk = _open_index(cache_dir, target, taps, max_new_tokens, topk)
    done = {int(i) for s in index["shards"] for i in s["prompts"]}
    todo = [i for i in range(len(prompts)) if i not in done]
    encoded = {i: encode_prompt_ids(tokenizer, prompts[i]) for i in todo}
    fmt = named_format(target, reply_format) if reply_format is not None else None
    gen = (batched_generator(target, taps, list(encoded.values()), max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                             topk=topk, width=batch_size or DEFAULT_WIDTH, fmt=fmt)
           if todo and (time_budget is None or time_budget > 0) else None)
    if gen is None and todo and fmt is not None and fmt.weights is not None:
        raise InvalidSettingError(f"--reply-format {reply_format} runs on the batched generator, which cannot run "
                                  f"this target: {unsupported(target)}")
    size = gen.width if gen is not None else batch_size or 16
    # similar lengths together (less padding) within windows of a few batches, so that a run stopped early
    # has answered the first prompts of the list, held-out ones included
    window = size * 8
    todo = [i for w in range(0, len(todo), window) for i in sorted(todo[w : w + window], key=lambda i: len(encoded[i]))]
    started = time.perf_counter()

    def admit() -> bool:
        return time_budget is None or time.perf_counter() - started < time_budget

    if gen is not None:
        shards = _batched_shards(gen, todo, encoded, size, admit)
    else:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (list(stop_ids) or [0])[0]
        shards = _transformers_shards(target, todo, encoded, size, admit, taps=taps, max_new_tokens=max_new_tokens,
                                      stop_ids=stop_ids, pad_id=pad_id, topk=topk)
    form = f"batched {gen.fmt.name}" if gen is not None else "transformers"
    t0 = time.perf_counter()
    for chunk, seqs in shards:
        _store_shard(cache_dir, index, chunk, seqs, form)
        done.update(chunk)
        if on_progress:
            new = sum(len(s.ids) - s.prompt_len for s in seqs)
            on_progress(len(done), len(prompts), new, time.perf_counter() - t0)
        t0 = time.perf_counter()
    return sorted(done)


def _open_index(cache_dir: Path, target: Target, taps: Sequence[int], max_new_tokens: int,
                topk: int) -> tuple[dict, int]:
    """The folder's index (a new one when it holds no answers) and the k of top-k to store; taps other than the
    folder's are an error."""
    index = read_index(cache_dir)
    key = {"taps": list(taps), "max_new_tokens": max_new_tokens, "target": target.name, "topk": topk}
    if index.get("key", key)["taps"] != list(taps):
        raise ValueError(f"{cache_dir} holds features of taps {index['key']['taps']}, not {list(taps)}: "
                         "use another cache folder")
    topk = key["topk"] = stored_topk(cache_dir, topk)
    if not index.get("shards"):
        index["key"], index["shards"] = key, []
    return index, topk


def _transformers_shards(target: Target, todo: list[int], encoded: dict[int, list[int]], size: int,
                         admit: Callable[[], bool], **options) -> Iterator[tuple[list[int], list[Example]]]:
    """(prompt indices, their examples) per batch of transformers' generate, while `admit()`."""
    for start in range(0, len(todo), size):
        if not admit():
            return
        chunk = todo[start : start + size]
        yield chunk, generate_batch(target, [encoded[i] for i in chunk], **options)


def _batched_shards(gen: BatchedGenerator, todo: list[int], encoded: dict[int, list[int]], size: int,
                    admit: Callable[[], bool]) -> Iterator[tuple[list[int], list[Example]]]:
    """(prompt indices, their examples) per `size` answers of the batched generator, in the order they finish."""
    chunk: list[int] = []
    seqs: list[Example] = []
    for i, example in gen.answers(((i, encoded[i]) for i in todo), admit):
        chunk.append(i)
        seqs.append(example)
        if len(chunk) == size:
            yield chunk, seqs
            chunk, seqs = [], []
    if chunk:
        yield chunk, seqs


def _store_shard(cache_dir: Path, index: dict, chunk: list[int], seqs: list[Example], form: str) -> None:
    """Writes one shard and then its entry in the index (an interrupted run never indexes a partial file)."""
    from dflash_cli.engine.files import save_tensors

    name = f"shard-{len(index['shards']):05d}.safetensors"
    tensors = {}
    for j, s in enumerate(seqs):
        tensors[f"ids.{j}"] = s.ids
        tensors[f"feat.{j}"] = s.features
        if s.top_ids is not None and s.top_logp is not None:
            tensors[f"top_ids.{j}"], tensors[f"top_logp.{j}"] = s.top_ids, s.top_logp
    save_tensors(tensors, cache_dir / name)
    index["shards"].append({"file": name, "prompts": chunk, "prompt_lens": [s.prompt_len for s in seqs],
                            "generator": form})
    _write_index(cache_dir, index)


def stored_topk(cache_dir: str | Path, topk: int) -> int:
    """The k of top-k distributions to store in `cache_dir`: the folder's own once it holds answers (asking
    for 0 goes on with it; asking for another k is an error), else `topk`."""
    index = read_index(Path(cache_dir))
    if not index.get("shards"):
        return topk
    stored = index["key"].get("topk", 0)
    if topk not in (0, stored):
        raise InvalidSettingError(f"{cache_dir} holds {f'top-{stored}' if stored else 'no'} distributions, "
                                  f"not top-{topk}", hint="use the same --distill-topk, or another output folder")
    return stored


def read_index(cache_dir: Path) -> dict:
    path = Path(cache_dir) / INDEX
    return json.loads(path.read_text()) if path.exists() else {}


def _write_index(cache_dir: Path, index: dict) -> None:
    tmp = cache_dir / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index))
    tmp.replace(cache_dir / INDEX)


def load_examples(cache_dir: str | Path) -> dict[int, Example]:
    """Every stored sequence, by prompt index (one read of each shard)."""
    from safetensors.torch import load_file

    cache_dir = Path(cache_dir)
    examples = {}
    for shard in read_index(cache_dir).get("shards", []):
        tensors = load_file(str(cache_dir / shard["file"]))
        for j, (pi, plen) in enumerate(zip(shard["prompts"], shard["prompt_lens"])):
            examples[pi] = Example(tensors[f"ids.{j}"], tensors[f"feat.{j}"], plen,
                                   tensors.get(f"top_ids.{j}"), tensors.get(f"top_logp.{j}"))
    return examples


def stored_prompt_ids(cache_dir: str | Path) -> dict[int, list[int]]:
    """Each stored answer's prompt tokens, by prompt index (reads only the token ids of each shard)."""
    from safetensors import safe_open

    cache_dir = Path(cache_dir)
    prompts: dict[int, list[int]] = {}
    for shard in read_index(cache_dir).get("shards", []):
        with safe_open(str(cache_dir / shard["file"]), framework="pt") as f:
            for j, (pi, plen) in enumerate(zip(shard["prompts"], shard["prompt_lens"])):
                prompts[pi] = f.get_slice(f"ids.{j}")[:plen].tolist()
    return prompts


def load_dataset(cache_dir: str | Path, prompt_ids: Sequence[int] | None = None) -> list[Example]:
    """The stored sequences (optionally only those of these prompt indices), ordered by prompt index."""
    examples = load_examples(cache_dir)
    wanted = sorted(examples) if prompt_ids is None else sorted(set(prompt_ids) & examples.keys())
    return [examples[i] for i in wanted]
