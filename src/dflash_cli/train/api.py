"""train_drafter: distils a DFlash drafter for a local causal LM, from data the target generates itself.

Output folder layout (the drafter itself is what the engine loads like any published drafter):
    OUT/config.json, OUT/model.safetensors   the drafter (public DFlash format) + a `training` entry
    OUT/data/                                 generated sequences + tapped features (resumable cache)
    OUT/checkpoint/latest.safetensors(+.json) drafter, optimizer, step, rng (resumable; no pickle)
    OUT/checkpoint/best.safetensors           the weights with the best held-out acceptance estimate so far
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from dflash_cli.engine.config import DrafterConfig, drafter_dict, fallback_taps
from dflash_cli.engine.device import pick_device, pick_dtype
from dflash_cli.engine.drafter import DFlashDrafter
from dflash_cli.engine.errors import InvalidSettingError
from dflash_cli.engine.generate import default_stop_ids
from dflash_cli.engine.load import load_target, save_drafter
from dflash_cli.train.data import build_dataset, load_examples, read_index, stored_topk
from dflash_cli.train.trainer import (
    TrainConfig,
    checkpoint_config,
    load_best_weights,
    make_head,
    sub_vocabulary,
    train_loop,
)

CHECKPOINT = Path("checkpoint") / "latest.safetensors"


def check_output_folder(out_dir: Path, target_dir: Path, taps: Sequence[int] | None) -> None:
    """Refuses, in one line and before anything loads or is written: taps the target does not have, an
    output folder that cannot be written, one whose training data another target generated (resuming would
    train on it and label the drafter with this target), and one holding a model no train run wrote there
    (a downloaded drafter, which training would overwrite)."""
    import os

    from dflash_cli.engine.config import text_config
    from dflash_cli.engine.pairing import read_config

    layers = int(text_config(read_config(target_dir, "target")).get("num_hidden_layers") or 0)
    bad = [t for t in taps or () if not 0 <= t < layers]
    if layers and bad:
        raise InvalidSettingError(f"--taps {','.join(map(str, taps or ()))}: {target_dir} has {layers} layers "
                                  f"(0..{layers - 1}), so {bad} cannot be tapped", hint="tap layers the target has")
    index = read_index(out_dir / "data") if (out_dir / "data").is_dir() else {}
    stored = (index.get("key") or {}).get("target") if index.get("shards") else None
    if stored is not None and Path(stored).expanduser().resolve() != target_dir.expanduser().resolve():
        raise InvalidSettingError(f"{out_dir} holds training data that {stored} generated, not {target_dir}",
                                  hint=f"train this target into another folder (-o), or pass -m {stored} to resume")
    ours = (out_dir / CHECKPOINT).exists() or (out_dir / "data").is_dir()
    theirs = (out_dir / "config.json").is_file() or any(out_dir.glob("*.safetensors")) if out_dir.is_dir() else False
    if theirs and not ours:
        raise InvalidSettingError(f"{out_dir} already holds a model that no train run wrote there: training would "
                                  "overwrite it", hint="write the new drafter to another folder (-o)")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InvalidSettingError(f"cannot create the output folder {out_dir}: {e.strerror or e}",
                                  hint="choose a folder you can write (-o)") from None
    if not os.access(out_dir, os.W_OK):
        raise InvalidSettingError(f"cannot write into the output folder {out_dir}",
                                  hint="choose a folder you can write (-o)")


def default_taps(num_target_layers: int, layers: int) -> list[int]:
    """The reference fallback spread (docs/format.md section 2) for max(layers, 5) taps, deduplicated:
    published drafters tap 5 layers, and more taps help a shallow drafter (prototype: 2 layers, 5 taps)."""
    n = min(max(layers, 5), num_target_layers)
    return sorted(set(fallback_taps(n, num_target_layers)))


def pick_mask_token(tokenizer, embed: torch.Tensor, seen: set[int]) -> tuple[int, str]:
    """A token id that never occurs in normal text, with a non-zero embedding row.

    In order: the highest special token the tokenizer declares that has no role (not bos/eos/pad/unk)
    and never occurs in the generated data; else the first embedding row past the tokenizer's vocabulary;
    else the highest id that never occurs in the data.
    """
    norms = embed.float().norm(dim=-1)
    usable = lambda i: 0 <= i < embed.shape[0] and i not in seen and norms[i] > 0  # noqa: E731
    roles = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    specials = [i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)]
    for i in sorted(specials, reverse=True):
        if i not in roles and usable(i):
            return i, "an unused special token of the tokenizer"
    if embed.shape[0] > len(tokenizer) and usable(len(tokenizer)):
        return len(tokenizer), "the first embedding row past the tokenizer's vocabulary"
    for i in range(embed.shape[0] - 1, -1, -1):
        if i not in roles and usable(i):
            return i, "the highest id absent from the generated data"
    raise InvalidSettingError("found no token id usable as the mask token")


def drafter_config(target_cfg, *, layers: int, block_size: int, taps: list[int], mask_id: int,
                   vocab_rows: int) -> dict[str, Any]:
    """A Qwen3-style drafter config shaped like the target's layers (public DFlash format)."""
    cfg = getattr(target_cfg, "text_config", None) or target_cfg
    heads = cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = getattr(cfg, "rope_theta", None) or rope.get("rope_theta") or 1e6
    return dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=cfg.hidden_size,
                intermediate_size=cfg.intermediate_size, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6), hidden_act="silu", attention_bias=False,
                rope_theta=float(theta), rope_scaling=None,
                max_position_embeddings=getattr(cfg, "max_position_embeddings", 4096),
                num_target_layers=cfg.num_hidden_layers, vocab_size=vocab_rows, tie_word_embeddings=False,
                layer_types=["full_attention"] * layers, sliding_window=None, use_sliding_window=False,
                block_size=block_size,
                dflash_config={"mask_token_id": mask_id, "target_layer_ids": taps, "block_size": block_size})


def init_drafter(raw: dict, device: torch.device, seed: int, final_norm: torch.Tensor | None = None) -> DFlashDrafter:
    torch.manual_seed(seed)
    drafter = DFlashDrafter(DrafterConfig.from_dict(raw))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
        if final_norm is not None:  # the target's LM head expects hidden states scaled by its own final norm
            drafter.norm.weight.copy_(final_norm.float())
    drafter.init_rotary(device)
    return drafter.to(device=device, dtype=torch.float32)  # fp32 master weights; compute may autocast


def read_init(init: str | Path, target_dir: str | Path, layers: int | None,
              taps: Sequence[int] | None) -> DFlashDrafter:
    """The drafter to fine-tune, on the CPU in fp32, checked against the target (from its config, before any
    weights load) and the shape options given with it (--block-size may differ)."""
    from dflash_cli.engine.load import load_drafter, read_drafter_config
    from dflash_cli.engine.pairing import check_pair, read_config

    check_pair(read_config(Path(target_dir), "target"), read_drafter_config(Path(init)),
               target_name=str(target_dir), drafter_name=str(init))
    drafter = load_drafter(init, device="cpu", dtype=torch.float32)
    drafter.draft_vocab = None  # the new training vocabulary decides it
    cfg = drafter.config
    if cfg.is_dflash2:
        raise InvalidSettingError(f"{init} is a DFlash 2 drafter", hint="train starts from DFlash v1 drafters only")
    # the block size may change: no weight depends on it (slots are positions, roped like any other)
    given = {"--layers": (layers, cfg.num_hidden_layers),
             "--taps": (list(taps) if taps is not None else None, list(cfg.target_layer_ids or []))}
    for option, (value, theirs) in given.items():
        if value is not None and value != theirs:
            raise InvalidSettingError(f"{option} {value} differs from the --init drafter's {theirs}",
                                      hint=f"drop {option}: a fine-tuned drafter keeps its shape")
    return drafter


def _seconds_trained(checkpoint: Path) -> float:
    meta = checkpoint.with_name(checkpoint.name + ".json")
    return json.loads(meta.read_text())["state"]["seconds"] if meta.exists() else 0.0


# names the kind of held-out estimate: checkpoints whose estimates were of another kind don't compare with it
HELDOUT_ESTIMATE = "replay"


def split_heldout(n: int) -> tuple[list[int], list[int]]:
    """Every 10th prompt (at most 32) is held out for the acceptance estimate; none below 4 prompts."""
    held = [i for i in range(9, n, 10)][:32] if n >= 10 else ([n - 1] if n >= 4 else [])
    return [i for i in range(n) if i not in set(held)], held


def _check_options(drafter_format: str, distill: float, distill_topk: int, draft_vocab: bool,
                   sub_vocab: bool) -> None:
    if drafter_format not in ("dflash", "transformers"):
        raise InvalidSettingError(f"unknown drafter format {drafter_format!r}", hint="use dflash or transformers")
    if not 0.0 <= distill <= 1.0:
        raise InvalidSettingError(f"--distill must be between 0 and 1, got {distill}")
    if distill > 0 and distill_topk <= 0:
        raise InvalidSettingError("--distill needs the target's top-k distributions", hint="add --distill-topk 32")
    if draft_vocab and not sub_vocab:
        raise InvalidSettingError("--draft-vocab needs the training vocabulary", hint="drop --full-vocab")


def _resolve_prompts(prompts: Sequence[str] | str | Path | None) -> tuple[list[str], list[str] | None, str]:
    """(prompts, their categories or None, how they were given, for the drafter's config)."""
    if prompts is None or isinstance(prompts, (str, Path)):
        from dflash_cli.train.prompt_sets import resolve_prompts_with_categories

        prompt_list, categories = resolve_prompts_with_categories(None if prompts is None else str(prompts))
        label = "built-in" if prompts is None else str(prompts)
    else:
        prompt_list, categories, label = list(prompts), None, f"{len(prompts)} prompts given to the API"
    if not prompt_list:
        raise InvalidSettingError("no prompts to train on")
    return prompt_list, categories, label


def _resumed_shape(out_dir: Path, asked: tuple[int | None, int | None], layers: int, block_size: int,
                   taps: Sequence[int] | None, target_layers: int) -> tuple[dict | None, list[int], int, int]:
    """(the checkpoint's config or None, taps, layers, block size): those of the checkpoint being resumed
    (asking for another shape is an error), else as asked with the default taps for the target's depth."""
    previous = checkpoint_config(out_dir / CHECKPOINT)
    if previous is None:
        return None, list(taps) if taps is not None else default_taps(target_layers, layers), layers, block_size
    layers = previous["num_hidden_layers"] if asked[0] is None else layers
    block_size = previous["block_size"] if asked[1] is None else block_size
    if previous["num_hidden_layers"] != layers or previous["block_size"] != block_size:
        raise InvalidSettingError(f"{out_dir} holds a checkpoint with {previous['num_hidden_layers']} layers "
                                  f"and block size {previous['block_size']}",
                                  hint="use the same --layers/--block-size to resume, or another output folder")
    return previous, list(previous["dflash_config"]["target_layer_ids"]), layers, block_size


def _training_sets(out_dir: Path, n_prompts: int, categories: list[str] | None, gen_time_budget: float | None):
    """The stored replies split into (train, held-out, held-out categories or None, held-out prompt ids)."""
    train_ids, held_ids = split_heldout(n_prompts)
    stored = {i: e for i, e in load_examples(out_dir / "data").items() if len(e.ids) - e.prompt_len >= 2}
    train_set = [stored[i] for i in train_ids if i in stored]
    held_set = [stored[i] for i in held_ids if i in stored]
    held_sets = [categories[i] for i in held_ids if i in stored] if categories else None
    if not train_set and gen_time_budget == 0:
        raise InvalidSettingError(f"no stored replies in {out_dir / 'data'} to train on "
                                  f"({len(stored)} usable, none outside the held-out set)" if stored else
                                  f"no stored replies in {out_dir / 'data'} to train on",
                                  hint="--gen-budget 0 trains on stored replies only: give it minutes to generate some")
    if not train_set:
        raise InvalidSettingError("the target produced no usable responses (each needs at least 2 tokens)")
    return train_set, held_set, held_sets, held_ids


def _init_config(start_from: DFlashDrafter, block_size: int) -> dict:
    """--init's config, without its training record, at the block size asked for."""
    raw = {k: v for k, v in start_from.config.raw.items() if k != "training"}
    if block_size != start_from.block_size:
        raw = drafter_dict(raw)
        raw["dflash_config"] = {**raw.get("dflash_config", {}), "block_size": block_size}
        if "block_size" in raw:  # older drafters also keep it at the top level
            raw["block_size"] = block_size
    return raw


def _training_record(state: Any, saved: Any, train_set: list, held_set: list) -> dict[str, Any]:
    """What the drafter's config records about the run that made it."""
    return dict(step=state.step, train_seconds=round(state.seconds, 1),
                train_sequences=len(train_set), heldout_sequences=len(held_set),
                train_tokens=sum(len(e.ids) - e.prompt_len for e in train_set),
                final_loss=sum(state.losses[-10:]) / max(len(state.losses[-10:]), 1),
                saved_step=saved[0] if saved else state.step,
                heldout_tau=saved[2] if saved else None,
                heldout_tau_by_set=saved[3] if saved and len(saved) > 3 and saved[3] else None,
                last_heldout_tau=state.evals[-1][2] if state.evals else None)


def train_drafter(target_dir: str | Path, out_dir: str | Path, *, prompts: Sequence[str] | str | Path | None = None,
                  layers: int | None = None, block_size: int | None = None, taps: Sequence[int] | None = None,
                  init: str | Path | None = None, lr: float = 6e-4,
                  steps: int | None = None, time_budget: float | None = None, batch: int = 4, anchors: int = 16,
                  gamma: float = 7.0, sub_vocab: bool = True, draft_vocab: bool = False, distill: float = 0.0,
                  distill_topk: int = 0, max_new_tokens: int = 200, gen_batch: int = 16,
                  gen_time_budget: float | None = None,
                  checkpoint_every: int = 100, eval_every: int = 50, seed: int = 0,
                  device: str | None = None, dtype: str | None = None, drafter_format: str = "dflash",
                  on_progress: Callable[[str, Any], None] | None = None) -> Path:
    """Distils a drafter for the target in `target_dir` and writes it to `out_dir`; returns out_dir.

    Args:
        prompts: prompt strings, or a `train --prompts` spec: a file (one per line or JSONL with "prompt"),
            a built-in set name (`demo`, `demo:N`), or None for the small built-in set.
        layers / block_size: the new drafter's shape (default 2 and 16, or those of `init`).
        init: a drafter folder to start from instead of random weights (fine-tuning it on new data); its
            layers, block size, taps and mask token are kept. Ignored when out_dir holds a checkpoint.
        steps / time_budget: total optimizer steps, or seconds of training (all runs of this out_dir).
        gen_time_budget: seconds of data generation in this run; prompts left unanswered wait for a
            later run, and training uses the answers stored so far.
        sub_vocab: compute the loss over the tokens occurring in the responses (and, with top-k data, the
            alternatives the target gave >= 5%) only: much faster on big vocabularies.
        draft_vocab: also ship those ids as the drafter's draft vocabulary (docs/format.md section 3), so
            that drafting runs the LM head on them only; needs sub_vocab.
        distill: weight of the KL term against the target's top-k distribution (0 = hard labels only).
        distill_topk: how many of the target's most likely tokens to store per response position (0 =
            none; needed by distill > 0). A data folder keeps the k it was started with.
        drafter_format: "dflash" (z-lab's checkpoint format) or "transformers" (muse_glimmer_assistant,
            loadable by transformers' MuseGlimmerAssistantModel); dflash-cli reads both.
        on_progress: called with ("data", dict(done, total, tokens, seconds)) per generated batch,
            ("train", trainer.Progress) per step and ("note", text) for things the user should know.
    Re-running with the same out_dir resumes: stored prompts are not generated again and training
    continues from the checkpoint (pass a larger `steps` to train further). The drafter written is the
    one with the best held-out acceptance estimate seen during training (the last one without held-out data).
    """
    _check_options(drafter_format, distill, distill_topk, draft_vocab, sub_vocab)
    steps = 1000 if steps is None and time_budget is None else steps
    check_output_folder(Path(out_dir), Path(target_dir), taps)  # all before the target loads
    stored_topk(Path(out_dir) / "data", distill_topk)
    start_from, asked, layers, block_size, taps = _asked_shape(init, target_dir, layers, block_size, taps)
    started, out_dir, dev = time.perf_counter(), Path(out_dir), pick_device(device)
    dt = pick_dtype(dtype, dev)
    call = dict(target=str(target_dir), lr=lr, steps=steps,
                time_budget=time_budget, batch=batch, anchors=anchors, gamma=gamma, sub_vocab=sub_vocab,
                draft_vocab=draft_vocab, distill=distill, distill_topk=distill_topk,
                max_new_tokens=max_new_tokens, seed=seed, dtype=str(dt).removeprefix("torch."))
    prompt_list, categories, call["prompts"] = _resolve_prompts(prompts)
    target, tokenizer = _load_target(target_dir, dev, dt)
    ckpt = out_dir / CHECKPOINT
    previous, taps, layers, block_size = _resumed_shape(out_dir, asked, layers, block_size, taps, target.num_layers)

    new_tokens = _generate_data(target, tokenizer, prompt_list, taps, out_dir / "data", max_new_tokens, gen_batch,
                                gen_time_budget, distill_topk, on_progress)
    train_set, held_set, held_sets, held_ids = _training_sets(out_dir, len(prompt_list), categories,
                                                              gen_time_budget)
    if previous is not None:
        raw = dict(previous)
    elif start_from is not None:
        raw = _init_config(start_from, block_size)
        call.update(init=str(init), init_training=start_from.config.raw.get("training"))
    else:
        raw, call["mask_token"] = _fresh_config(target, tokenizer, train_set + held_set, layers, block_size, taps)
    raw["training"] = {**raw.get("training", {}), **call, "layers": layers, "block_size": block_size}
    drafter = _build_drafter(raw, target, dev, seed, start_from if previous is None else None)
    head, vocab_ids = _vocabularies(target, train_set, sub_vocab, draft_vocab, dev)
    raw["training"].update({"draft_vocab_size": len(vocab_ids)} if vocab_ids is not None else {})
    cfg = TrainConfig(steps=steps, time_budget=time_budget, lr=lr, batch=min(batch, len(train_set)),
                      anchors=anchors, gamma=gamma, checkpoint_every=checkpoint_every, eval_every=eval_every,
                      seed=seed, warmup=min(50, max(1, (steps or 1000) // 20)), distill=distill)
    if previous is not None and new_tokens and on_progress:
        _note_spent_budget(ckpt, time_budget, on_progress)
    state, saved = _train(drafter, target, head, (train_set, held_set, held_sets, held_ids), cfg, ckpt,
                          dt if dt != torch.float32 else None, vocab_ids, on_progress)
    raw["training"].update(_training_record(state, saved, train_set, held_set))
    _write_drafter(drafter, raw, vocab_ids, dt, out_dir, drafter_format)
    (out_dir / "training_log.json").write_text(json.dumps(
        {"losses": state.losses, "evals": state.evals, "wall_seconds": time.perf_counter() - started}))
    return out_dir


def _asked_shape(init: str | Path | None, target_dir: str | Path, layers: int | None, block_size: int | None,
                 taps: Sequence[int] | None):
    """(the --init drafter or None, the (layers, block size) asked for, layers, block size, taps): --init's
    shape where it gives one, else 2 layers and blocks of 16."""
    start_from = read_init(init, target_dir, layers, taps) if init is not None else None
    if start_from is not None:
        layers, block_size = start_from.config.num_hidden_layers, block_size or start_from.block_size
        taps = list(start_from.config.target_layer_ids or [])
    asked = (layers, block_size)
    return (start_from, asked, 2 if layers is None else layers, 16 if block_size is None else block_size, taps)


def _note_spent_budget(ckpt: Path, time_budget: float | None, on_progress: Callable[[str, Any], None]) -> None:
    """New data arrived, but the folder's training budget is already spent: say so, or it would look trained."""
    if time_budget is not None and _seconds_trained(ckpt) >= time_budget:
        on_progress("note", f"the training budget ({time_budget / 60:g} min, counted over all runs of this "
                            "folder) is already spent: pass a larger --time-budget to train on the new data")


def _train(drafter: DFlashDrafter, target: Any, head: Any, sets: tuple, cfg: TrainConfig, ckpt: Path,
           autocast: torch.dtype | None, vocab_ids: torch.Tensor | None,
           on_progress: Callable[[str, Any], None] | None) -> tuple[Any, Any]:
    """Runs the training loop; returns its state and the evaluation whose weights the drafter now holds
    (the best held-out estimate when its weights were kept, else the last)."""
    train_set, held_set, held_sets, held_ids = sets
    drafter.embed_scale = target.embed_scale  # blocks embedded as the target embeds tokens (Gemma: sqrt(H))
    state = train_loop(drafter, target.embed_weight, target.lm_head, head, train_set, held_set, cfg, ckpt,
                       heldout_key=HELDOUT_ESTIMATE + ":" + ",".join(map(str, held_ids)), autocast_dtype=autocast,
                       draft_vocab=vocab_ids, heldout_sets=held_sets,
                       on_progress=(lambda p: on_progress("train", p)) if on_progress else None)
    saved = state.evals[-1] if state.evals else None
    if state.best is not None and state.best != saved and load_best_weights(ckpt, drafter, state.best):
        saved = state.best
    return state, saved


def _load_target(target_dir: str | Path, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoTokenizer

    return load_target(target_dir, device=device, dtype=dtype), AutoTokenizer.from_pretrained(str(target_dir))


def _vocabularies(target: Any, train_set: list, sub_vocab: bool, draft_vocab: bool,
                  device: torch.device) -> tuple[Any, torch.Tensor | None]:
    """(the LM head the loss runs, on the training vocabulary with sub_vocab; the draft vocabulary to ship)."""
    sub_ids = sub_vocabulary(train_set) if sub_vocab else None
    vocab_ids = sub_ids.to(device) if draft_vocab and sub_ids is not None else None
    return make_head(target.lm_head, sub_ids), vocab_ids


def _build_drafter(raw: dict, target: Any, device: torch.device, seed: int,
                   start_from: DFlashDrafter | None) -> DFlashDrafter:
    """The drafter to train: from `raw`, its final norm from the target's, its weights from `start_from`
    (--init, on a first run) when given."""
    final_norm = getattr(target.model.get_decoder(), "norm", None)
    drafter = init_drafter(raw, device, seed, final_norm.weight.detach() if final_norm is not None else None)
    if start_from is not None:
        drafter.load_state_dict({k: v.float() for k, v in start_from.state_dict().items()}, strict=True)
    return drafter


def _write_drafter(drafter: DFlashDrafter, raw: dict, vocab_ids: torch.Tensor | None, dtype: torch.dtype,
                   out_dir: Path, drafter_format: str) -> None:
    drafter.config.raw.clear()
    drafter.config.raw.update(raw)
    drafter.draft_vocab = vocab_ids
    save_drafter(drafter.to(dtype), out_dir, format=drafter_format)


def _generate_data(target: Any, tokenizer: Any, prompts: list[str], taps: list[int], data_dir: Path,
                   max_new_tokens: int, gen_batch: int, gen_time_budget: float | None, topk: int,
                   on_progress: Callable[[str, Any], None] | None) -> int:
    """Answers the prompts not stored yet (build_dataset); returns the new reply tokens."""
    new_tokens = [0]

    def data_progress(done: int, total: int, tokens: int, seconds: float) -> None:
        new_tokens[0] += tokens
        if on_progress:
            on_progress("data", dict(done=done, total=total, tokens=tokens, seconds=seconds))

    build_dataset(target, tokenizer, prompts, taps, data_dir, max_new_tokens=max_new_tokens, batch_size=gen_batch,
                  stop_ids=default_stop_ids(target, tokenizer), on_progress=data_progress,
                  time_budget=gen_time_budget, topk=topk)
    return new_tokens[0]


def _fresh_config(target: Any, tokenizer: Any, examples: list, layers: int, block_size: int,
                  taps: list[int]) -> tuple[dict, str]:
    """A new drafter's config, with a mask token the stored replies never use, and why that token."""
    seen = set(torch.cat([e.ids for e in examples]).tolist())
    mask_id, why = pick_mask_token(tokenizer, target.embed_weight, seen)
    return drafter_config(target.config, layers=layers, block_size=block_size, taps=taps, mask_id=mask_id,
                          vocab_rows=target.vocab_rows), why
