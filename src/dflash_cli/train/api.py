"""train_drafter: distils a DFlash drafter for a local causal LM, from data the target generates itself.

Its steps: the checks (before anything loads), the drafter's shape (train/shape.py), the data (the target's
replies, train/data.py), the fit (train/trainer.py) and the write (train/output.py, which also describes
the output folder).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from dflash_cli.engine.device import pick_device, pick_dtype
from dflash_cli.engine.drafter import DFlashDrafter
from dflash_cli.engine.errors import InvalidSettingError
from dflash_cli.engine.generate import default_stop_ids
from dflash_cli.engine.load import load_target
from dflash_cli.train.config import TrainConfig
from dflash_cli.train.data import Example, build_dataset, load_examples, stored_topk
from dflash_cli.train.output import (
    CHECKPOINT,
    TrainResult,
    check_output_folder,
    seconds_trained,
    training_record,
    write_drafter,
)
from dflash_cli.train.shape import Shape, build_drafter, check_taps, drafter_raw, drafter_shape, read_init
from dflash_cli.train.trainer import Evaluation, State, load_best_weights, make_head, sub_vocabulary, train_loop

if TYPE_CHECKING:
    from dflash_cli.train.prompts import SelfPart

OnProgress = Callable[[str, Any], None]

# names the kind of held-out estimate: checkpoints whose estimates were of another kind don't compare with it
HELDOUT_ESTIMATE = "replay"


def train_drafter(target_dir: str | Path, out_dir: str | Path, config: TrainConfig | None = None, *,
                  prompts: Sequence[str] | str | Path | None = None, init: str | Path | None = None,
                  device: str | None = None, dtype: str | None = None, on_progress: OnProgress | None = None,
                  **options: Any) -> TrainResult:
    """Distils a drafter for the target in `target_dir` and writes it to `out_dir`.

    Args:
        config: how to train (train/config.py: the options, their defaults and checks); `options` are
            TrainConfig's fields too, for short calls (`train_drafter(t, o, steps=200)`), and replace
            those of `config` when both are given.
        prompts: prompt strings, or a `train --prompts` spec: a file (one per line or JSONL with "prompt"),
            a built-in set name (`demo`, `demo:N`, `mix`, `mix:N`, `wide`, `wide:N`), `self:N` (N prompts
            the target writes itself, train/prompts/self_written.py), several joined by `+`, or None for the small
            built-in set.
        init: a drafter folder to start from instead of random weights (fine-tuning it on new data); its
            layers, taps and mask token are kept, its block size unless one is given. Ignored when out_dir
            holds a checkpoint.
        device, dtype: where and in what dtype the target runs (default: the best available).
        on_progress: called with ("prompts", dict(sampled, upto, wanted, tokens, seconds)) while self prompts
            are sampled, ("data", dict(done, total, tokens, seconds)) per generated batch,
            ("train", trainer.Progress) per step and ("note", text) for things the user should know.
    Re-running with the same out_dir resumes: stored prompts are not generated again and training
    continues from the checkpoint (pass a larger `steps` to train further). The drafter written is the
    one with the best held-out acceptance estimate seen during training (the last one without held-out data).
    """
    config = replace(config, **options) if config is not None else TrainConfig(**options)
    target_dir, out_dir, started = Path(target_dir), Path(out_dir), time.perf_counter()
    start_from = _check_before_loading(target_dir, out_dir, config, init, prompts)
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    target, tokenizer = _load_target(target_dir, dev, dt)
    prompt_set = _resolve_prompts(prompts, _self_sampler(target, tokenizer, out_dir, config, on_progress))
    shape = drafter_shape(config, start_from, init, out_dir, target.num_layers)
    data = training_data(target, tokenizer, prompt_set, shape.taps, out_dir, config, on_progress)
    if start_from is not None and data.vocab is not None and start_from.draft_vocab is not None:
        # a fine-tune keeps the ids its --init drafter drafted: a narrower round must not lose them
        data.vocab = torch.unique(torch.cat([data.vocab, start_from.draft_vocab.to(data.vocab.device)]))
    draft_vocab = data.vocab.to(dev) if config.draft_vocab and data.vocab is not None else None
    raw, origin = drafter_raw(shape, target, tokenizer, data.train + data.heldout)
    # recorded before the drafter is built: its config, saved with each checkpoint, keeps it for a resumed run
    raw["training"] = {**raw.get("training", {}), "target": str(target_dir),
                       **_run_record(config, dt, prompt_set.label, origin, shape, draft_vocab)}
    drafter = build_drafter(raw, target, dev, config.seed, shape)
    if shape.resumed is not None and data.new_tokens and on_progress:
        _note_spent_budget(out_dir, config.time_budget, on_progress)
    state, record = fit_drafter(drafter, target, data, draft_vocab, config, out_dir / CHECKPOINT, dt, on_progress)
    raw["training"].update(record)
    return write_drafter(out_dir, drafter, raw, draft_vocab, dt, config.drafter_format, state,
                         time.perf_counter() - started)


def _check_before_loading(target_dir: Path, out_dir: Path, config: TrainConfig, init: str | Path | None,
                          prompts: Sequence[str] | str | Path | None) -> DFlashDrafter | None:
    """Every refusal that needs no weights, before the target loads; returns --init's drafter, if any."""
    if isinstance(prompts, (str, Path)):
        from dflash_cli.train.prompts import check_prompt_spec

        check_prompt_spec(str(prompts))
    check_taps(target_dir, config.taps)
    check_output_folder(out_dir, target_dir)
    stored_topk(out_dir / "data", config.distill_topk)
    return read_init(init, target_dir, config.layers, config.taps) if init is not None else None


def _run_record(config: TrainConfig, dtype: torch.dtype, prompts: str, origin: dict[str, Any], shape: Shape,
                draft_vocab: torch.Tensor | None) -> dict[str, Any]:
    """What the drafter's training record says of this run's options (`origin`: shape.drafter_raw's)."""
    return dict(lr=config.lr, steps=config.total_steps, time_budget=config.time_budget, batch=config.batch,
                anchors=config.anchors, gamma=config.gamma, sub_vocab=config.sub_vocab,
                draft_vocab=config.draft_vocab, distill=config.distill, distill_topk=config.distill_topk,
                max_new_tokens=config.max_new_tokens, seed=config.seed, dtype=str(dtype).removeprefix("torch."),
                prompts=prompts, **origin, layers=shape.layers, block_size=shape.block_size,
                **({"draft_vocab_size": len(draft_vocab)} if draft_vocab is not None else {}))


def _load_target(target_dir: Path, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoTokenizer

    return load_target(target_dir, device=device, dtype=dtype), AutoTokenizer.from_pretrained(str(target_dir))


def _note_spent_budget(out_dir: Path, time_budget: float | None, on_progress: OnProgress) -> None:
    """New data arrived, but the folder's training budget is already spent: say so, or it would look trained."""
    if time_budget is not None and seconds_trained(out_dir) >= time_budget:
        on_progress("note", f"the training budget ({time_budget / 60:g} min, counted over all runs of this "
                            "folder) is already spent: pass a larger --time-budget to train on the new data")


# -- the data -------------------------------------------------------------------------------------------

class PromptSet(NamedTuple):
    texts: list[str]
    categories: list[str] | None  # each prompt's category, for the built-in sets
    label: str  # how they were given, for the drafter's training record
    part_sizes: list[int]  # the lengths of the parts of a joined spec (`mix:24000+wide:8000`), in order


def _resolve_prompts(prompts: Sequence[str] | str | Path | None, self_part: SelfPart | None = None) -> PromptSet:
    if prompts is None or isinstance(prompts, (str, Path)):
        from dflash_cli.train.prompts import join_prompt_parts, resolve_prompt_parts

        parts = resolve_prompt_parts(None if prompts is None else str(prompts), self_part)
        texts, categories = join_prompt_parts(parts)
        prompt_set = PromptSet(texts, categories, "built-in" if prompts is None else str(prompts),
                               [len(part) for part, _ in parts])
    else:
        prompt_set = PromptSet(list(prompts), None, f"{len(prompts)} prompts given to the API", [len(prompts)])
    if not prompt_set.texts:
        raise InvalidSettingError("no prompts to train on")
    return prompt_set


def _self_sampler(target: Any, tokenizer: Any, out_dir: Path, config: TrainConfig,
                  on_progress: OnProgress | None) -> SelfPart:
    """What samples a spec's `self:N` part: N prompts the target writes (train/prompts/self_written.py), kept in
    out_dir."""

    def sample(n: int) -> tuple[list[str], list[str]]:
        from dflash_cli.train.prompts.self_written import SelfPromptSettings, sample_self_prompts, summary_line

        result = sample_self_prompts(target, tokenizer, n, out_dir, SelfPromptSettings(seed=config.seed),
                                     stop_ids=default_stop_ids(target, tokenizer), width=config.gen_batch,
                                     on_progress=(lambda info: on_progress("prompts", info)) if on_progress else None)
        if on_progress:
            on_progress("note", summary_line(result, out_dir))
        return result.prompts, result.categories

    return sample


@dataclass
class TrainingData:
    train: list[Example]
    heldout: list[Example]
    heldout_sets: list[str] | None  # each held-out reply's prompt category, for the built-in sets
    heldout_ids: list[int]  # the prompts held out (their index in the prompt list)
    vocab: torch.Tensor | None  # the training vocabulary, with sub_vocab (trainer.sub_vocabulary)
    new_tokens: int  # reply tokens generated in this run


def training_data(target: Any, tokenizer: Any, prompt_set: PromptSet, taps: list[int], out_dir: Path,
                  config: TrainConfig, on_progress: OnProgress | None) -> TrainingData:
    """Answers the prompts not stored yet, then splits the stored replies into training and held-out ones."""
    check_stored_prompts(prompt_set.texts, tokenizer, out_dir / "data")  # before any answer is added
    new_tokens = _generate(target, tokenizer, prompt_set.texts, taps, out_dir / "data", config, on_progress)
    train_ids, held_ids = split_prompts(prompt_set.texts, prompt_set.part_sizes)
    stored = {i: e for i, e in load_examples(out_dir / "data").items() if len(e.ids) - e.prompt_len >= 2}
    train_set = [stored[i] for i in train_ids if i in stored]
    if not train_set and config.gen_time_budget == 0:
        raise InvalidSettingError(f"no stored replies in {out_dir / 'data'} to train on "
                                  f"({len(stored)} usable, none outside the held-out set)" if stored else
                                  f"no stored replies in {out_dir / 'data'} to train on",
                                  hint="--gen-budget 0 trains on stored replies only: give it minutes to generate some")
    if not train_set:
        raise InvalidSettingError("the target produced no usable responses (each needs at least 2 tokens)")
    categories = prompt_set.categories
    return TrainingData(train_set, [stored[i] for i in held_ids if i in stored],
                        [categories[i] for i in held_ids if i in stored] if categories else None, held_ids,
                        sub_vocabulary(train_set) if config.sub_vocab else None, new_tokens)


def check_stored_prompts(texts: Sequence[str], tokenizer: Any, data_dir: Path) -> None:
    """Stored answers are found by their prompt's place in the list: each must start with the tokens of the
    prompt now at that place, or the list was given in another order than when they were generated."""
    from dflash_cli.train.data import encode_prompt_ids, stored_prompt_ids

    for i, ids in stored_prompt_ids(data_dir).items():
        if i < len(texts) and ids != encode_prompt_ids(tokenizer, texts[i]):
            raise InvalidSettingError(
                f"{data_dir} holds an answer to another prompt at place {i} of the prompt list: the prompts were "
                "listed in another order when it was generated",
                hint="list the sets as the earlier runs did and add new ones at the end (mix:24000+wide:8000), "
                     "or use another output folder")


def split_prompts(texts: Sequence[str], part_sizes: Sequence[int]) -> tuple[list[int], list[int]]:
    """`split_heldout` over the parts, less the training prompts whose text is also held out (joined sets can
    list one prompt twice)."""
    train_ids, held_ids = split_heldout(len(texts), part_sizes)
    held_texts = {texts[i] for i in held_ids}
    return [i for i in train_ids if texts[i] not in held_texts], held_ids


def split_heldout(n: int, part_sizes: Sequence[int] | None = None) -> tuple[list[int], list[int]]:
    """Every 10th prompt (at most 32) of each part of the list is held out for the acceptance estimate; none
    below 4 prompts. `part_sizes` (default: one part of n) are the lengths of the sets a joined spec lists."""
    held: list[int] = []
    start = 0
    for size in part_sizes or [n]:
        held += [start + i for i in (list(range(9, size, 10))[:32] if size >= 10 else [size - 1] if size >= 4 else [])]
        start += size
    held_set = set(held)
    return [i for i in range(n) if i not in held_set], held


def _generate(target: Any, tokenizer: Any, prompts: list[str], taps: list[int], data_dir: Path,
              config: TrainConfig, on_progress: OnProgress | None) -> int:
    """Answers the prompts not stored yet (build_dataset); returns the new reply tokens."""
    new_tokens = [0]

    def data_progress(done: int, total: int, tokens: int, seconds: float) -> None:
        new_tokens[0] += tokens
        if on_progress:
            on_progress("data", dict(done=done, total=total, tokens=tokens, seconds=seconds))

    build_dataset(target, tokenizer, prompts, taps, data_dir, max_new_tokens=config.max_new_tokens,
                  batch_size=config.gen_batch, stop_ids=default_stop_ids(target, tokenizer),
                  on_progress=data_progress, time_budget=config.gen_time_budget, topk=config.distill_topk,
                  reply_format=config.reply_format)
    return new_tokens[0]


# -- the fit --------------------------------------------------------------------------------------------

def fit_drafter(drafter: DFlashDrafter, target: Any, data: TrainingData, draft_vocab: torch.Tensor | None,
                config: TrainConfig, checkpoint: Path, dtype: torch.dtype,
                on_progress: OnProgress | None) -> tuple[State, dict[str, Any]]:
    """Trains `drafter` in place (resuming `checkpoint`), leaving it with the weights of the best held-out
    estimate when they were kept, else the last; returns the loop's state and what the drafter's training
    record says of the fit."""
    drafter.embed_scale = target.embed_scale  # blocks embedded as the target embeds tokens (Gemma: sqrt(H))
    head = make_head(target.lm_head, data.vocab, softcap=drafter.config.final_logit_softcapping)
    state = train_loop(drafter, target.embed_weight, target.lm_head, head,
                       data.train, data.heldout, replace(config, batch=min(config.batch, len(data.train))),
                       checkpoint, heldout_key=HELDOUT_ESTIMATE + ":" + ",".join(map(str, data.heldout_ids)),
                       autocast_dtype=dtype if dtype != torch.float32 else None, draft_vocab=draft_vocab,
                       heldout_sets=data.heldout_sets,
                       on_progress=(lambda p: on_progress("train", p)) if on_progress else None)
    saved: Evaluation | None = state.evals[-1] if state.evals else None
    if state.best is not None and state.best != saved and load_best_weights(checkpoint, drafter, state.best):
        saved = state.best
    return state, training_record(state, saved, data.train, data.heldout)
