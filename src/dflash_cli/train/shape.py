"""The drafter's shape, from --init, the checkpoint being resumed or the options, and the drafter built to it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_cli.engine.drafter import DFlashDrafter
from dflash_cli.engine.errors import InvalidSettingError
from dflash_cli.engine.hf_config import DrafterConfig, drafter_dict, fallback_taps
from dflash_cli.train.config import DEFAULT_BLOCK_SIZE, DEFAULT_LAYERS, TrainConfig
from dflash_cli.train.output import CHECKPOINT
from dflash_cli.train.trainer import checkpoint_config


@dataclass
class Shape:
    layers: int
    block_size: int
    taps: list[int]
    resumed: dict | None = None  # the config of the checkpoint being resumed
    init: DFlashDrafter | None = None  # --init's drafter, when this run starts from its weights
    init_dir: str | None = None


def check_taps(target_dir: Path, taps: Sequence[int] | None) -> None:
    """Refuses taps the target does not have, from its config (before anything loads)."""
    from dflash_cli.engine.hf_config import text_config
    from dflash_cli.engine.pairing import read_config

    layers = int(text_config(read_config(target_dir, "target")).get("num_hidden_layers") or 0)
    bad = [t for t in taps or () if not 0 <= t < layers]
    if layers and bad:
        raise InvalidSettingError(f"--taps {','.join(map(str, taps or ()))}: {target_dir} has {layers} layers "
                                  f"(0..{layers - 1}), so {bad} cannot be tapped", hint="tap layers the target has")


def read_init(init: str | Path, target_dir: str | Path, layers: int | None,
              taps: Sequence[int] | None) -> DFlashDrafter:
    """The drafter to fine-tune, on the CPU in fp32, checked against the target (from its config, before any
    weights load) and the shape options given with it (--block-size may differ)."""
    from dflash_cli.engine.load import load_drafter, read_drafter_config
    from dflash_cli.engine.pairing import check_pair, read_config

    check_pair(read_config(Path(target_dir), "target"), read_drafter_config(Path(init)),
               target_name=str(target_dir), drafter_name=str(init))
    drafter = load_drafter(init, device="cpu", dtype=torch.float32)
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


def default_taps(num_target_layers: int, layers: int) -> list[int]:
    """The reference fallback spread (docs/format.md section 2) for max(layers, 5) taps, deduplicated:
    published drafters tap 5 layers, and more taps help a shallow drafter (prototype: 2 layers, 5 taps)."""
    n = min(max(layers, 5), num_target_layers)
    return sorted(set(fallback_taps(n, num_target_layers)))


def drafter_shape(config: TrainConfig, start_from: DFlashDrafter | None, init_dir: str | Path | None,
                  out_dir: Path, target_layers: int) -> Shape:
    """--init's layers and taps (at the block size asked for), else those asked for; then the checkpoint's
    being resumed (asking for another shape is an error), else the defaults for what was not asked."""
    layers, block_size, taps = config.layers, config.block_size, config.taps
    if start_from is not None:
        layers, taps = start_from.config.num_hidden_layers, list(start_from.config.target_layer_ids or [])
        block_size = block_size or start_from.block_size
    previous = checkpoint_config(out_dir / CHECKPOINT)
    if previous is not None:
        return _resumed_shape(previous, layers, block_size, out_dir)
    layers = DEFAULT_LAYERS if layers is None else layers
    return Shape(layers, DEFAULT_BLOCK_SIZE if block_size is None else block_size,
                 list(taps) if taps is not None else default_taps(target_layers, layers),
                 init=start_from, init_dir=None if init_dir is None else str(init_dir))


def _resumed_shape(previous: dict, layers: int | None, block_size: int | None, out_dir: Path) -> Shape:
    theirs = previous["num_hidden_layers"], previous["block_size"]
    if (layers or theirs[0], block_size or theirs[1]) != theirs:
        raise InvalidSettingError(f"{out_dir} holds a checkpoint with {theirs[0]} layers and block size {theirs[1]}",
                                  hint="use the same --layers/--block-size to resume, or another output folder")
    return Shape(*theirs, taps=list(previous["dflash_config"]["target_layer_ids"]), resumed=previous)


def drafter_raw(shape: Shape, target: Any, tokenizer: Any, examples: list) -> tuple[dict, dict[str, Any]]:
    """The drafter's config, and what its training record says of where it came from: the resumed
    checkpoint's, --init's at the block size asked for, or a new one with a mask token the replies never use."""
    if shape.resumed is not None:
        return dict(shape.resumed), {}
    if shape.init is not None:
        return _init_config(shape.init, shape.block_size), dict(init=shape.init_dir,
                                                                init_training=shape.init.config.raw.get("training"))
    seen = set(torch.cat([e.ids for e in examples]).tolist())
    mask_id, why = pick_mask_token(tokenizer, target.embed_weight, seen)
    raw = drafter_config(target.config, layers=shape.layers, block_size=shape.block_size, taps=shape.taps,
                         mask_id=mask_id, vocab_rows=target.vocab_rows)
    raw["dflash_config"]["draft_window"] = draft_window_for([len(e.ids) for e in examples])
    return raw, dict(mask_token=why)


def draft_window_for(lengths: Sequence[int]) -> int:
    """The context window a new drafter drafts with (dflash_config.draft_window): the median length of the
    sequences it trained on, up to a power of two, at least 64. A drafter trained on short sequences drafts
    worse behind thousands of tokens of context than with a window; the demo's (prompts and replies of a few
    hundred tokens) drafted best with 128-256 (benchmarks/README.md, "The drafter context window, measured")."""
    ordered = sorted(lengths)
    median = ordered[len(ordered) // 2] if ordered else 0
    return max(64, 1 << max(0, median - 1).bit_length())


def _init_config(start_from: DFlashDrafter, block_size: int) -> dict:
    """--init's config, without its training record, at the block size asked for."""
    raw = {k: v for k, v in start_from.config.raw.items() if k != "training"}
    if block_size != start_from.block_size:
        raw = drafter_dict(raw)
        raw["dflash_config"] = {**raw.get("dflash_config", {}), "block_size": block_size}
        if "block_size" in raw:  # older drafters also keep it at the top level
            raw["block_size"] = block_size
    return raw


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
    text = getattr(target_cfg, "text_config", None) or target_cfg
    # the saved values, not attributes: a per-layer config (Gemma 4's global layers) refuses a global read
    cfg = text.to_dict() if hasattr(text, "to_dict") else dict(vars(text))
    heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # per layer type (Gemma 4): the global layers' rotary
    theta = cfg.get("rope_theta") or rope.get("rope_theta") or 1e6
    # the target's logit soft-cap (Gemma): decoding caps the drafter's logits with it, and the loss does too
    softcap = cfg.get("final_logit_softcapping")
    capped = {"final_logit_softcapping": float(softcap)} if softcap else {}
    # a mixture of experts may name no dense MLP size (Qwen3.5-MoE): 3x hidden, Qwen3's dense ratio
    mlp = cfg.get("intermediate_size") or 3 * cfg["hidden_size"]
    return dict(**capped, architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=cfg["hidden_size"],
                intermediate_size=mlp, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                rms_norm_eps=cfg.get("rms_norm_eps") or 1e-6, hidden_act="silu", attention_bias=False,
                rope_theta=float(theta), rope_scaling=None,
                max_position_embeddings=cfg.get("max_position_embeddings") or 4096,
                num_target_layers=cfg["num_hidden_layers"], vocab_size=vocab_rows, tie_word_embeddings=False,
                layer_types=["full_attention"] * layers, sliding_window=None, use_sliding_window=False,
                block_size=block_size,
                dflash_config={"mask_token_id": mask_id, "target_layer_ids": taps, "block_size": block_size})


def build_drafter(raw: dict, target: Any, device: torch.device, seed: int, shape: Shape) -> DFlashDrafter:
    """The drafter to train: from `raw`, its final norm from the target's, its weights --init's when this run
    starts from them (a resumed run loads the checkpoint's later)."""
    final_norm = getattr(target.model.get_decoder(), "norm", None)
    drafter = init_drafter(raw, device, seed, final_norm.weight.detach() if final_norm is not None else None)
    if shape.init is not None:
        weights = {k: v.float() for k, v in shape.init.state_dict().items() if k != "draft_vocab"}
        drafter.load_state_dict(weights, strict=True)  # the draft vocabulary is the training data's (api.py)
    return drafter


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
