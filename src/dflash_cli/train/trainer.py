"""The training loop: random anchors per sequence, weighted block loss, AdamW, checkpoints, held-out tau.

Recipe (DFlash paper): the target is frozen and only supplies features, embeddings and its LM head. Each
step takes `batch` sequences and `anchors` random anchors in each response; block a is
[x_p, MASK x (B-1)] at positions p..p+B-1 and slot k (1..B-1) is trained to predict x_{p+k} with weight
exp(-(k-1)/gamma), since a draft is accepted only up to its first miss.

A slot's loss is (1 - distill) * cross-entropy against the target's greedy token + distill * KL(p || q),
where p is the target's distribution at that position restricted to its stored top-k tokens (those in the
training vocabulary, renormalised) and q the drafter's: the whole distribution carries more signal per
generated token than its argmax alone.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dflash_cli.engine.drafter import DFlashDrafter
from dflash_cli.train.config import TrainConfig
from dflash_cli.train.data import Example
from dflash_cli.train.estimate import accepted_runs, first_tokens, replay, replay_tau
from dflash_cli.train.forward import IGNORE, block_embeddings, block_labels, training_forward


@dataclass
class Progress:
    step: int
    total: int | None
    loss: float
    lr: float
    seconds: float  # training seconds so far (all runs)
    tokens_per_s: float  # block slots trained per second in this run
    tau: float | None = None  # latest held-out acceptance estimate
    eval_loss: float | None = None


@dataclass
class Head:
    """The target's frozen LM head, optionally restricted to a sub-vocabulary for the loss, with the logit
    soft-cap decoding applies to the drafter's logits (Gemma), so the loss sees the distribution drafts use."""

    weight: torch.Tensor  # (V', H)
    bias: torch.Tensor | None
    lut: torch.Tensor | None = None  # (V,) full id -> row of `weight`, -1 when absent; None = full vocabulary
    softcap: float | None = None  # cap * tanh(logits / cap)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = F.linear(h, self.weight.to(h.dtype), None if self.bias is None else self.bias.to(h.dtype))
        return logits if not self.softcap else torch.tanh(logits / self.softcap) * self.softcap

    def map_labels(self, labels: torch.Tensor) -> torch.Tensor:
        if self.lut is None:
            return labels
        mapped = self.lut[labels.clamp(min=0)]
        return torch.where((labels < 0) | (mapped < 0), IGNORE, mapped)

    def map_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of `weight` for full-vocabulary ids, -1 for ids outside the sub-vocabulary."""
        return ids if self.lut is None else self.lut[ids]


def make_head(lm_head: torch.nn.Linear, sub_ids: torch.Tensor | None, softcap: float | None = None) -> Head:
    weight, bias = lm_head.weight.detach(), getattr(lm_head, "bias", None)
    if sub_ids is None:
        return Head(weight, bias, softcap=softcap)
    lut = torch.full((weight.shape[0],), -1, dtype=torch.long, device=weight.device)
    lut[sub_ids.to(weight.device)] = torch.arange(len(sub_ids), device=weight.device)
    sub = sub_ids.to(weight.device)
    return Head(weight[sub].contiguous(), None if bias is None else bias.detach()[sub], lut, softcap)


def sub_vocabulary(examples: list[Example], min_prob: float = 0.05) -> torch.Tensor:
    """Sorted ids of every token that occurs in the responses, plus, with top-k data, every alternative
    the target gave at least `min_prob` somewhere: the ids the loss targets, and the draft vocabulary."""
    parts = [e.ids[e.prompt_len :] for e in examples]
    cutoff = math.log(min_prob)
    for e in examples:
        if e.top_ids is not None and e.top_logp is not None:
            parts.append(e.top_ids[e.top_logp.float() >= cutoff].long())
    return torch.unique(torch.cat(parts))


class Batch(NamedTuple):
    ids: torch.Tensor  # (N, L) padded token ids
    features: torch.Tensor  # (N, L, D) tapped features
    lengths: torch.Tensor  # (N,)
    anchors: torch.Tensor  # (N, A) anchor positions in the responses
    top_ids: torch.Tensor | None  # (N, L, k) the target's top-k ids for the token at each position
    top_logp: torch.Tensor | None  # (N, L, k) their log-probabilities (0 rows in prompts and padding)


def make_batch(examples: list[Example], n_anchors: int, block_size: int, rng: random.Random, device) -> Batch:
    """Padded sequences and `n_anchors` anchors drawn from each response (top-k tables when all have them)."""
    width = max(len(e.ids) for e in examples)
    dim = examples[0].features.shape[1]
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    feats = torch.zeros(len(examples), width, dim, dtype=examples[0].features.dtype)
    anchors = torch.zeros(len(examples), n_anchors, dtype=torch.long)
    with_top = all(e.top_ids is not None for e in examples)
    k = examples[0].top_ids.shape[1] if with_top and examples[0].top_ids is not None else 0
    top_ids = torch.zeros(len(examples), width, k, dtype=torch.long)
    top_logp = torch.full((len(examples), width, k), -math.inf)
    for i, e in enumerate(examples):
        n = len(e.ids)
        ids[i, :n] = e.ids
        feats[i, : n - 1] = e.features
        if with_top and e.top_ids is not None and e.top_logp is not None:
            top_ids[i, e.prompt_len : n] = e.top_ids
            top_logp[i, e.prompt_len : n] = e.top_logp.float()
        # the anchor is a committed response token with at least one token after it
        candidates = range(e.prompt_len, n - 1)
        picks = (rng.sample(candidates, n_anchors) if len(candidates) >= n_anchors
                 else [rng.choice(candidates) for _ in range(n_anchors)])
        anchors[i] = torch.tensor(sorted(picks))
    lengths = torch.tensor([len(e.ids) for e in examples])
    return Batch(ids.to(device), feats.to(device), lengths.to(device), anchors.to(device),
                 top_ids.to(device) if with_top else None, top_logp.to(device) if with_top else None)


def slot_weights(block_size: int, gamma: float, device) -> torch.Tensor:
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    return torch.where(k > 0, torch.exp(-(k - 1) / gamma), torch.zeros_like(k))


def topk_kl(logq: torch.Tensor, top_rows: torch.Tensor, top_logp: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per slot, p = the target's top-k distribution restricted to the rows present (>= 0) and
    renormalised; 0 where no row is present. logq (S, V') log-probs; top_rows, top_logp (S, k)."""
    present = (top_rows >= 0) & (top_logp > -math.inf)
    logp = torch.where(present, top_logp, -math.inf)
    logp = logp - torch.logsumexp(logp, dim=-1, keepdim=True)
    p = torch.where(present, logp.exp(), 0.0)
    q = logq.gather(-1, top_rows.clamp(min=0))
    return torch.where(present, p * (logp - q), 0.0).sum(-1)


def block_loss(drafter: DFlashDrafter, embed: torch.Tensor, head: Head, batch: Batch, gamma: float,
               autocast_dtype: torch.dtype | None,
               distill: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted per-slot loss of one batch (module docstring); also returns the full-id labels (N, A, B)
    and the hidden states."""
    bsz = drafter.block_size
    labels = block_labels(batch.ids, batch.lengths, batch.anchors, bsz, IGNORE)
    dev = batch.ids.device
    with torch.autocast(dev.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        h = training_forward(drafter, batch.features, block_embeddings(drafter, batch.ids, batch.anchors, embed),
                             batch.anchors)
        logits = head.logits(h)
    mapped = head.map_labels(labels).flatten()
    logq = torch.log_softmax(logits.float().flatten(0, 1), dim=-1)
    loss = -logq.gather(-1, mapped.clamp(min=0)[:, None])[:, 0]
    if distill > 0:
        if batch.top_ids is None or batch.top_logp is None:
            raise ValueError("distillation needs top-k data (generate it with topk > 0)")
        n, a = batch.anchors.shape
        pos = (batch.anchors[:, :, None] + torch.arange(bsz, device=dev)).clamp(max=batch.ids.shape[1] - 1)
        k = batch.top_ids.shape[-1]
        index = pos.view(n, a * bsz, 1).expand(-1, -1, k)
        rows = head.map_ids(batch.top_ids.gather(1, index)).flatten(0, 1)  # (N*A*B, k)
        top_logp = batch.top_logp.gather(1, index).flatten(0, 1)
        loss = (1 - distill) * loss + distill * topk_kl(logq, rows, top_logp)
    w = slot_weights(bsz, gamma, dev).repeat(labels.shape[0] * labels.shape[1]) * (mapped != IGNORE)
    return (loss * w).sum() / w.sum().clamp(min=1e-6), labels, h


class Estimate(NamedTuple):
    loss: float  # held-out loss at random anchors (the training loss's kind)
    tau: float  # held-out acceptance estimate (train/estimate.py)
    by_set: dict[str, float]  # the estimate per prompt category, when the prompts have categories


@torch.no_grad()
def evaluate(drafter: DFlashDrafter, embed: torch.Tensor, full_head: torch.nn.Linear, sub_head: Head,
             examples: list[Example], cfg: TrainConfig, autocast_dtype,
             draft_vocab: torch.Tensor | None = None, sets: list[str] | None = None) -> Estimate:
    """Held-out loss at fixed random anchors, and tau from greedy decoding replayed over each reply
    (train/estimate.py), drafting as the engine will: over the draft vocabulary (`sub_head`, whose rows are
    the ids `draft_vocab`) when there is one, else with the full LM head. `sets` names each example's
    prompt category for the per-set estimates.
    """
    was_training = drafter.training
    drafter.eval()
    rng = random.Random(1234)
    losses = []
    device = embed.device
    for i in range(0, len(examples), cfg.batch):
        batch = make_batch(examples[i : i + cfg.batch], cfg.anchors, drafter.block_size, rng, device)
        loss, _, _ = block_loss(drafter, embed, sub_head, batch, cfg.gamma, autocast_dtype, cfg.distill)
        losses.append(loss.item())

    def draft_ids(h: torch.Tensor) -> torch.Tensor:
        if draft_vocab is not None:
            return draft_vocab.to(device)[sub_head.logits(h).argmax(-1)]
        return full_head(h.to(full_head.weight.dtype)).argmax(-1)

    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        per_reply = [replay(accepted_runs(drafter, embed, draft_ids, first_tokens(e))) for e in examples]
    drafter.train(was_training)
    tau, by_set = replay_tau(per_reply, sets)
    return Estimate(sum(losses) / max(len(losses), 1), tau, by_set)


def lr_at(cfg: TrainConfig, step: int, seconds: float) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr over the steps (or the time budget)."""
    warmup, steps = cfg.warmup_steps, cfg.total_steps
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if steps is not None:
        frac = (step - warmup) / max(steps - warmup, 1)
    else:  # no step count: the time budget ends the training (TrainConfig.total_steps)
        frac = seconds / (cfg.time_budget or math.inf)
    frac = min(max(frac, 0.0), 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


Evaluation = tuple[int, float, float, dict[str, float]]  # (step, held-out loss, tau, tau per prompt set)


@dataclass
class State:
    step: int = 0
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)
    evals: list[Evaluation] = field(default_factory=list)
    best: Evaluation | None = None  # the eval whose weights are in best.safetensors
    heldout_key: str | None = None  # which held-out set the evals were measured on


def best_weights_path(checkpoint: Path) -> Path:
    return checkpoint.with_name("best.safetensors")


def _better(new: Evaluation, old: Evaluation | None) -> bool:
    """Higher held-out tau wins; at equal tau, lower held-out loss."""
    return old is None or (new[2], -new[1]) > (old[2], -old[1])


def save_checkpoint(path: Path, drafter, optim, state: State, rng: random.Random) -> None:
    """A resumable checkpoint without pickle: tensors in `path` (safetensors), the rest in path.json."""
    from dflash_cli.engine.files import save_tensors

    path.parent.mkdir(parents=True, exist_ok=True)
    optim_state = optim.state_dict()
    tensors = {f"drafter.{k}": v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    for index, slots in optim_state["state"].items():
        for name, value in slots.items():
            tensors[f"optim.{index}.{name}"] = torch.as_tensor(value).detach().contiguous().cpu()
    tensors["torch_rng"] = torch.get_rng_state()
    meta = {"state": state.__dict__, "rng": _jsonable(rng.getstate()), "config": drafter.config.raw,
            "param_groups": optim_state["param_groups"]}
    tmp = path.with_name(path.name + ".tmp")
    save_tensors(tensors, tmp)
    tmp_meta = path.with_name(path.name + ".json.tmp")
    tmp_meta.write_text(json.dumps(meta))
    tmp.replace(path)
    tmp_meta.replace(path.with_name(path.name + ".json"))


def _save_weights(path: Path, drafter, evaluation: Evaluation) -> None:
    from dflash_cli.engine.files import save_tensors

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_tensors({k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}, tmp,
                 metadata={"step": str(evaluation[0])})
    tmp.replace(path)


def load_best_weights(checkpoint: Path, drafter, evaluation: Evaluation) -> bool:
    """Loads the weights saved at `evaluation` (step, ...) into `drafter`. False, loading nothing,
    when the file is missing or holds another step's weights (a run stopped between two saves)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = best_weights_path(checkpoint)
    if not path.exists():
        return False
    with safe_open(str(path), framework="pt") as f:
        if (f.metadata() or {}).get("step") != str(evaluation[0]):
            return False
    drafter.load_state_dict({k: v.to(drafter.fc.weight.device) for k, v in load_file(str(path)).items()})
    return True


def _jsonable(value):
    return [_jsonable(v) for v in value] if isinstance(value, (tuple, list)) else value


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def checkpoint_config(path: Path) -> dict | None:
    """The drafter config stored with a checkpoint, or None when there is none."""
    meta = path.with_name(path.name + ".json")
    return json.loads(meta.read_text())["config"] if path.exists() and meta.exists() else None


def load_checkpoint(path: Path, drafter, optim, rng: random.Random) -> State:
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    meta = json.loads(path.with_name(path.name + ".json").read_text())
    drafter.load_state_dict({k[len("drafter."):]: v for k, v in tensors.items() if k.startswith("drafter.")})
    slots: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, index, name = key.split(".", 2)
            slots.setdefault(int(index), {})[name] = value
    optim.load_state_dict({"state": slots, "param_groups": meta["param_groups"]})
    rng.setstate(_tuples(meta["rng"]))
    torch.set_rng_state(tensors["torch_rng"])
    saved = meta["state"]
    return State(**{**saved, "evals": [tuple(e) for e in saved["evals"]],
                    "best": tuple(saved["best"]) if saved.get("best") else None})


def train_loop(drafter: DFlashDrafter, embed: torch.Tensor, lm_head: torch.nn.Linear, head: Head,
               train: list[Example], heldout: list[Example], cfg: TrainConfig, checkpoint: Path, *,
               heldout_key: str | None = None, autocast_dtype: torch.dtype | None = None,
               draft_vocab: torch.Tensor | None = None, heldout_sets: list[str] | None = None,
               on_progress: Callable[[Progress], None] | None = None) -> State:
    """Trains `drafter` in place, resuming from `checkpoint` when it exists; saves it every N steps."""
    drafter.train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    optim = _optimizer(params, cfg, embed.device)
    rng = random.Random(cfg.seed)
    state = load_checkpoint(checkpoint, drafter, optim, rng) if checkpoint.exists() else State()
    if state.heldout_key != heldout_key:  # estimates on another held-out set (or of another kind) don't compare
        state.best, state.evals, state.heldout_key = None, [], heldout_key
    run_start, run_slots, base_seconds = time.perf_counter(), 0, state.seconds
    batches = _batches(train, cfg, drafter.block_size, rng, embed.device)
    while not cfg.finished(state.step, state.seconds):
        batch = next(batches)
        lr = lr_at(cfg, state.step, state.seconds)
        state.losses.append(_optimizer_step(drafter, embed, head, batch, cfg, optim, params, lr, autocast_dtype))
        state.step += 1
        run_slots += batch.anchors.numel() * drafter.block_size
        state.seconds = base_seconds + time.perf_counter() - run_start
        last = cfg.finished(state.step, state.seconds)
        if heldout and (state.step % cfg.eval_every == 0 or last):
            state.evals.append((state.step, *evaluate(drafter, embed, lm_head, head, heldout, cfg, autocast_dtype,
                                                      draft_vocab, heldout_sets)))
            if _better(state.evals[-1], state.best):
                state.best = state.evals[-1]
                _save_weights(best_weights_path(checkpoint), drafter, state.best)
        if state.step % cfg.checkpoint_every == 0 or last:
            save_checkpoint(checkpoint, drafter, optim, state, rng)
        if on_progress:
            eval_loss, tau = state.evals[-1][1:3] if state.evals else (None, None)
            on_progress(Progress(state.step, cfg.total_steps, state.losses[-1], lr, state.seconds,
                                 run_slots / max(time.perf_counter() - run_start, 1e-9), tau, eval_loss))
    return state


def _optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW, with weight decay on the matrices only."""
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1], "weight_decay": cfg.weight_decay},
                              {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def _batches(train: list[Example], cfg: TrainConfig, block_size: int, rng: random.Random,
             device: torch.device) -> Iterator[Batch]:
    """Batches of `cfg.batch` sequences, each sequence once per shuffled pass (a short last pass is dropped)."""
    order: list[int] = []
    while True:
        if len(order) < cfg.batch:
            order = list(range(len(train)))
            rng.shuffle(order)
        picked, order = order[: cfg.batch], order[cfg.batch :]
        yield make_batch([train[i] for i in picked], cfg.anchors, block_size, rng, device)


def _optimizer_step(drafter: DFlashDrafter, embed: torch.Tensor, head: Head, batch: Batch, cfg: TrainConfig,
                    optim: torch.optim.Optimizer, params: list[torch.nn.Parameter], lr: float,
                    autocast_dtype: torch.dtype | None) -> float:
    """One step at learning rate `lr`, gradients clipped to norm 1; returns the batch's loss."""
    for g in optim.param_groups:
        g["lr"] = lr
    loss, _, _ = block_loss(drafter, embed, head, batch, cfg.gamma, autocast_dtype, cfg.distill)
    optim.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optim.step()
    return loss.item()
