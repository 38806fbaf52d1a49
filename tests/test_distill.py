"""Distillation data and loss (top-k distributions, KL term), the optional draft vocabulary, --init."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import (
    DEVICE,
    VOCAB,
    dflash2_config,
    drafter_config,
    random_drafter,
    save_random_drafter,
    target_config,
)
from safetensors.torch import load_file, save_file

from dflash_cli.engine.errors import CheckpointError, InvalidSettingError
from dflash_cli.engine.load import attach_drafter, load_drafter, load_target, save_drafter

PROMPTS = [f"prompt {i}: tell me about {w}" for i, w in enumerate("cats dogs rain sun code math tea wind".split())]


# -- top-k data ---------------------------------------------------------------------------------------

def test_topk_rows_are_the_targets_own_distribution_at_each_response_token(tiny_target_dir):
    from dflash_cli.train.data import generate_batch

    target = load_target(tiny_target_dir, device=DEVICE, dtype="float32")
    prompts = [[5, 9, 30, 41], [70, 71, 72, 3, 8, 100, 12]]  # different lengths: left padding is exercised
    examples = generate_batch(target, prompts, [1, 4], max_new_tokens=12, stop_ids=[2], pad_id=0, topk=5)
    for prompt, e in zip(prompts, examples):
        response = e.ids[e.prompt_len :]
        assert e.top_ids is not None and e.top_logp is not None
        assert e.top_ids.shape == e.top_logp.shape == (len(response), 5)
        assert e.top_ids[:, 0].long().tolist() == response.tolist()  # greedy: the top-1 is the token chosen
        # an independent unpadded forward over the whole sequence gives the same distributions
        with torch.no_grad():
            logits = target.model(e.ids[None].to(DEVICE)).logits[0, e.prompt_len - 1 : -1].float()
        logp = torch.log_softmax(logits, dim=-1).cpu()
        assert torch.equal(e.top_ids.long(), logp.topk(5).indices)
        torch.testing.assert_close(e.top_logp.float(), logp.topk(5).values, atol=2e-3, rtol=1e-3)


def test_topk_tables_are_stored_and_a_cache_keeps_its_k(tmp_path, tiny_target_dir):
    from transformers import AutoTokenizer

    from dflash_cli.train.data import build_dataset, load_dataset

    target = load_target(tiny_target_dir, device=DEVICE, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_target_dir))
    build_dataset(target, tokenizer, PROMPTS[:3], [1, 4], tmp_path / "data", max_new_tokens=6, batch_size=2, topk=4)
    stored = load_dataset(tmp_path / "data")
    assert len(stored) == 3
    for e in stored:
        assert e.top_ids is not None and e.top_ids.dtype == torch.int32 and e.top_ids.shape[1] == 4
        assert e.top_logp is not None and e.top_logp.dtype == torch.float16
        assert len(e.top_ids) == len(e.ids) - e.prompt_len
    with pytest.raises(InvalidSettingError, match="top-4 distributions, not top-8"):
        build_dataset(target, tokenizer, PROMPTS[:4], [1, 4], tmp_path / "data", max_new_tokens=6, topk=8)
    # asking for none goes on storing the folder's top-4
    build_dataset(target, tokenizer, PROMPTS[:4], [1, 4], tmp_path / "data", max_new_tokens=6, topk=0)
    assert all(e.top_ids is not None and e.top_ids.shape[1] == 4 for e in load_dataset(tmp_path / "data"))
    # a folder of answers without distributions cannot start storing them
    build_dataset(target, tokenizer, PROMPTS[:2], [1, 4], tmp_path / "plain", max_new_tokens=6)
    with pytest.raises(InvalidSettingError, match="holds no distributions, not top-4"):
        build_dataset(target, tokenizer, PROMPTS[:3], [1, 4], tmp_path / "plain", max_new_tokens=6, topk=4)


# -- the loss -----------------------------------------------------------------------------------------

def test_topk_kl_against_a_hand_computed_value():
    from dflash_cli.train.trainer import topk_kl

    logits = [2.0, 1.0, 0.0, -1.0]
    logq = torch.log_softmax(torch.tensor([logits]), dim=-1)
    # the target's top-3 ids 0, 2, 3 with probabilities .6 / .3 / .05; id 3 is outside the sub-vocabulary
    rows = torch.tensor([[0, 2, -1]])
    top_logp = torch.log(torch.tensor([[0.6, 0.3, 0.05]]))
    z = sum(math.exp(x) for x in logits)
    q0, q2 = math.exp(2.0) / z, math.exp(0.0) / z
    p0, p2 = 0.6 / 0.9, 0.3 / 0.9  # renormalised over the ids present
    expected = p0 * math.log(p0 / q0) + p2 * math.log(p2 / q2)
    assert topk_kl(logq, rows, top_logp).item() == pytest.approx(expected, rel=1e-5)
    # nothing present (a padded slot): 0, not NaN
    empty = topk_kl(logq, torch.tensor([[-1, -1, -1]]), torch.full((1, 3), -math.inf))
    assert empty.item() == 0.0
    # q equal to p on the ids present: 0
    same = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    assert topk_kl(same, torch.tensor([[0, 1, 2]]), same).item() == pytest.approx(0.0, abs=1e-7)


def _examples(tiny_target_dir, topk):
    from dflash_cli.train.data import generate_batch
    from dflash_cli.train.trainer import make_head

    target = load_target(tiny_target_dir, device=DEVICE, dtype="float32")
    examples = generate_batch(target, [[5, 9, 30, 41], [70, 71, 72, 3, 8]], [1, 3, 4], max_new_tokens=20,
                              stop_ids=[], pad_id=0, topk=topk)
    return target, examples, make_head(target.lm_head, None)


def reference_block_loss(h, weight, batch, block_size, gamma, distill, softcap=None):
    """block_loss written out slot by slot from its definition, independent of the trainer's code: slot k
    (1..B-1) of the block at anchor p predicts x_{p+k} (if inside the sequence) with weight exp(-(k-1)/gamma);
    its loss is (1 - distill) * cross-entropy + distill * KL(p || q), p = the target's stored top-k
    distribution of position p+k renormalised over its k ids, q = softmax of the drafter's logits there;
    the result is the weighted mean over the slots. With `softcap`, q is of softcap * tanh(logits / softcap)."""
    total = weights = 0.0
    n_seq, n_anchors = batch.anchors.shape
    for i in range(n_seq):
        for a in range(n_anchors):
            anchor = int(batch.anchors[i, a])
            for k in range(1, block_size):
                pos = anchor + k
                if pos >= int(batch.lengths[i]):
                    continue
                logits = h[i, a * block_size + k].double() @ weight.double().T
                if softcap:
                    logits = softcap * torch.tanh(logits / softcap)
                logq = torch.log_softmax(logits, dim=-1)
                cross_entropy = -logq[int(batch.ids[i, pos])]
                top_p = torch.softmax(batch.top_logp[i, pos].double(), dim=-1)  # renormalised over the top k
                kl = sum(pj * (torch.log(pj) - logq[int(j)]) for pj, j in zip(top_p, batch.top_ids[i, pos]))
                w = math.exp(-(k - 1) / gamma)
                total = total + w * ((1 - distill) * cross_entropy + distill * kl)
                weights += w
    return total / weights


def test_block_loss_mixes_cross_entropy_and_kl_per_slot(tiny_target_dir):
    """Each mix of the hard and the distillation loss against reference_block_loss, values and gradients
    (with respect to the drafter's hidden states, so a detached term shows)."""
    import random

    from dflash_cli.train.trainer import block_loss, make_batch

    target, examples, head = _examples(tiny_target_dir, topk=6)
    drafter = random_drafter(drafter_config(target_config("qwen3"), block_size=4), seed=3).to(DEVICE)
    drafter.init_rotary(torch.device(DEVICE))
    batch = make_batch(examples, 3, 4, random.Random(0), DEVICE)
    assert batch.top_ids is not None and batch.top_logp is not None
    # and the last anchor of each sequence two tokens before its end: slot 3 of that block predicts nothing
    at_end = batch.anchors.clone()
    at_end[:, -1] = batch.lengths - 2
    values = {}
    for which, b in (("random anchors", batch), ("a block past the end", batch._replace(anchors=at_end))):
        for distill in (0.0, 1.0, 0.25):
            loss, _, h = block_loss(drafter, target.embed_weight, head, b, 7.0, None, distill)
            expected = reference_block_loss(h, target.lm_head.weight.detach(), b, 4, 7.0, distill)
            assert loss.item() == pytest.approx(expected.item(), rel=1e-5), (which, distill)
            got_grad, = torch.autograd.grad(loss, h, retain_graph=True)
            want_grad, = torch.autograd.grad(expected, h)
            torch.testing.assert_close(got_grad, want_grad.to(got_grad.dtype), rtol=1e-4, atol=1e-7)
            values[which, distill] = loss.item()
    hard, kl = values["random anchors", 0.0], values["random anchors", 1.0]
    assert kl > 0 and hard > kl  # a random drafter; the hard label has p = 1
    mixed, _, _ = block_loss(drafter, target.embed_weight, head, batch, 7.0, None, 0.25)
    mixed.backward()
    assert all(torch.isfinite(p.grad).all() for p in drafter.parameters() if p.grad is not None)
    no_top = batch._replace(top_ids=None, top_logp=None)
    with pytest.raises(ValueError, match="needs top-k data"):
        block_loss(drafter, target.embed_weight, head, no_top, 7.0, None, 0.5)


def test_a_soft_capped_head_puts_the_cap_into_the_loss(tiny_target_dir):
    """A Gemma target caps its logits, and decoding caps the drafter's with the same cap: the loss must see
    the capped distribution (a cap of a quarter of the largest logit changes it)."""
    import random

    from dflash_cli.train.trainer import block_loss, make_batch, make_head

    target, examples, plain = _examples(tiny_target_dir, topk=6)
    drafter = random_drafter(drafter_config(target_config("qwen3"), block_size=4), seed=3).to(DEVICE)
    drafter.init_rotary(torch.device(DEVICE))
    batch = make_batch(examples, 3, 4, random.Random(0), DEVICE)
    uncapped, _, h = block_loss(drafter, target.embed_weight, plain, batch, 7.0, None, 0.5)
    cap = plain.logits(h).abs().max().item() / 4
    capped = make_head(target.lm_head, None, softcap=cap)
    loss, _, h = block_loss(drafter, target.embed_weight, capped, batch, 7.0, None, 0.5)
    weight = target.lm_head.weight.detach()
    assert loss.item() == pytest.approx(reference_block_loss(h, weight, batch, 4, 7.0, 0.5, cap).item(), rel=1e-5)
    assert uncapped.item() != pytest.approx(loss.item(), rel=1e-2)
    sub = make_head(target.lm_head, torch.tensor([3, 5, 8, 13]), softcap=cap)  # the sub-vocabulary keeps it
    torch.testing.assert_close(sub.logits(h[0, :2]), capped.logits(h[0, :2])[:, [3, 5, 8, 13]])


def test_a_one_hot_distribution_on_the_label_gives_the_cross_entropy(tiny_target_dir):
    """Aligns the stored rows with the slots: the KL against a one-hot p on each position's own token is
    exactly that slot's cross-entropy, only if slot k of the block at p reads the row of position p+k."""
    import random

    from dflash_cli.train.trainer import block_loss, make_batch

    target, examples, head = _examples(tiny_target_dir, topk=6)
    drafter = random_drafter(drafter_config(target_config("qwen3"), block_size=4), seed=3).to(DEVICE)
    drafter.init_rotary(torch.device(DEVICE))
    batch = make_batch(examples, 3, 4, random.Random(0), DEVICE)
    assert batch.top_ids is not None and batch.top_logp is not None
    top_ids = batch.top_ids.clone()
    top_ids[:, :, 0] = batch.ids
    top_logp = torch.full_like(batch.top_logp, -math.inf)
    top_logp[:, :, 0] = 0.0
    one_hot = batch._replace(top_ids=top_ids, top_logp=top_logp)
    hard, _, _ = block_loss(drafter, target.embed_weight, head, one_hot, 7.0, None, 0.0)
    kl, _, _ = block_loss(drafter, target.embed_weight, head, one_hot, 7.0, None, 1.0)
    assert kl.item() == pytest.approx(hard.item(), rel=1e-5)
    shifted = one_hot._replace(top_ids=top_ids.roll(1, dims=1))  # each row one position late
    wrong, _, _ = block_loss(drafter, target.embed_weight, head, shifted, 7.0, None, 1.0)
    assert wrong.item() != pytest.approx(hard.item(), rel=1e-3)


def test_distilled_training_lowers_the_kl_and_the_drafter_stays_lossless(tmp_path, tiny_target_dir):
    from dflash_cli.engine.generate import generate
    from dflash_cli.engine.load import load_pair
    from dflash_cli.train.api import train_drafter

    events = []
    out = train_drafter(tiny_target_dir, tmp_path / "out", prompts=PROMPTS, layers=2, block_size=8, steps=30,
                        batch=4, anchors=8, max_new_tokens=40, eval_every=10, lr=1e-3, device=DEVICE,
                        dtype="float32", distill=1.0, distill_topk=8, draft_vocab=True,
                        on_progress=lambda kind, info: events.append((kind, info))).folder
    losses = [p.loss for kind, p in events if kind == "train"]
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
    training = json.loads((out / "config.json").read_text())["training"]
    assert training["distill"] == 1.0 and training["distill_topk"] == 8
    stored = load_file(str(out / "model.safetensors"))
    assert stored["draft_vocab"].dtype == torch.int64 and training["draft_vocab_size"] == len(stored["draft_vocab"])
    pair = load_pair(tiny_target_dir, out, device=DEVICE, dtype="float32")
    assert pair.drafter is not None and pair.drafter.draft_vocab is not None
    plain_target = load_target(tiny_target_dir, device=DEVICE, dtype="float32")
    from transformers import AutoTokenizer

    from dflash_cli.engine.text import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_target_dir))
    accepted = 0
    for prompt in (encode_prompt(tokenizer, PROMPTS[0]), encode_prompt(tokenizer, PROMPTS[5])):
        plain = generate(plain_target, None, prompt, max_new_tokens=30, stop_ids=[])
        spec = generate(pair.target, pair.drafter, prompt, max_new_tokens=30, stop_ids=[])
        assert spec.tokens == plain.tokens
        accepted += spec.stats.accepted
    assert accepted > 0  # drafts from the draft vocabulary were accepted, not only rejected


def test_distill_options_are_checked_before_anything_loads(tmp_path):
    from click.testing import CliRunner

    from dflash_cli.ui.cli import cli

    missing = str(tmp_path / "no-such-target")
    for args, message in ((["--distill", "0.5"], "--distill needs the target's top-k distributions"),
                          (["--draft-vocab", "--full-vocab"], "--draft-vocab needs the training vocabulary"),
                          (["--steps", "9", "--time-budget", "1"], "give --steps or --time-budget, not both")):
        result = CliRunner().invoke(cli, ["train", "-m", missing, "-o", str(tmp_path / "o"), *args])
        assert result.exit_code == 2 and message in result.output, result.output
        assert "Traceback" not in result.output


# -- the draft vocabulary -----------------------------------------------------------------------------

def _restricted_and_full(tmp_path, tiny_target_dir, vocab_ids):
    """The target, a drafter restricted to `vocab_ids` (attached), and the same weights over the full vocabulary."""
    folder = _drafter_with_vocab(tmp_path, vocab_ids)
    target = load_target(tiny_target_dir, device=DEVICE, dtype="float32")
    drafter = load_drafter(folder, device=DEVICE, dtype="float32")
    full = load_drafter(folder, device=DEVICE, dtype="float32")
    full.draft_vocab = None
    attach_drafter(target, drafter)
    return target, drafter, full

def _drafter_with_vocab(tmp_path, ids, cfg=None):
    cfg = cfg or drafter_config(target_config("qwen3"))
    folder = save_random_drafter(tmp_path / "d", cfg, seed=2, scale=3.0)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["draft_vocab"] = ids
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_drafts_come_from_the_draft_vocabulary_only(tmp_path, tiny_target_dir):
    from dflash_cli.engine.sampling import Sampler

    vocab_ids = torch.arange(3, VOCAB, 3)  # a third of the vocabulary
    target, drafter, full = _restricted_and_full(tmp_path, tiny_target_dir, vocab_ids)
    context = target.forward(torch.tensor([[5, 9, 30, 41]], device=DEVICE), target.new_cache(), 0, taps=True)[1]
    anchor = torch.tensor([7], device=DEVICE)
    got = drafter.draft(context, anchor, 4, 8, drafter.new_cache(), target.embed_table, target.lm_head)
    _, logits = full.draft_logits(context, anchor, 4, 8, full.new_cache(), target.embed_table, target.lm_head, None)
    outside = torch.ones(VOCAB, dtype=torch.bool, device=DEVICE)
    outside[vocab_ids] = False
    want = logits.masked_fill(outside, -torch.inf).argmax(-1)
    assert got.tolist() == want.tolist()
    assert got.tolist() != logits.argmax(-1).tolist()  # the restriction changed something
    sampled = drafter.draft(context, anchor, 4, 8, drafter.new_cache(), target.embed_table, target.lm_head,
                            sampler=Sampler(temperature=1.5, seed=3))
    assert set(sampled.tolist()) <= set(vocab_ids.tolist())


def test_sampled_drafts_from_a_draft_vocabulary_are_the_samplers_choice_at_each_position(tmp_path, tiny_target_dir):
    """Coupled drafts over a draft vocabulary (the full-vocabulary twin is in test_sampling.py): the draft
    for position start+1+i is the sampler's own pick, with that position's noise, from the draft logits
    scattered to the target's vocabulary (-inf elsewhere). Drafts merely inside the vocabulary, and a
    lossless output, would not show a draft drawn with another position's noise: only lower acceptance."""
    from dflash_cli.engine.sampling import Sampler, sampling_probs

    vocab_ids = torch.arange(3, VOCAB, 3)  # a third of the vocabulary
    target, drafter, full = _restricted_and_full(tmp_path, tiny_target_dir, vocab_ids)
    context = target.forward(torch.tensor([[5, 9, 30, 41, 17, 23]], device=DEVICE), target.new_cache(), 0,
                             taps=True)[1]
    anchor, start, block = torch.tensor([7], device=DEVICE), 6, drafter.block_size
    _, logits = full.draft_logits(context, anchor, start, block, full.new_cache(), target.embed_table,
                                  target.lm_head, None)  # (B-1, V): the drafter's logits over every id
    scattered = torch.full_like(logits.float(), -torch.inf)
    scattered[:, vocab_ids] = logits.float()[:, vocab_ids]
    temperature, top_p = 1.0, 0.95
    probs = sampling_probs(scattered, temperature, top_p)
    mismatched_noise = 0
    for seed in range(6):
        sampler = Sampler(temperature=temperature, top_p=top_p, seed=seed)
        got = drafter.draft(context, anchor, start, block, drafter.new_cache(), target.embed_table,
                            target.lm_head, sampler=sampler)

        def pick(first: int) -> list[int]:  # the sampler's choice with the noise of positions first, first+1, ..
            noise = torch.stack([-torch.log(-torch.log(sampler.uniform(first + i, VOCAB, probs.device)))
                                 for i in range(len(probs))])
            return (probs.log() + noise).argmax(-1).tolist()

        want = pick(start + 1)  # slot 1 drafts the token at position start + 1
        assert got.tolist() == want, seed
        for neighbour in (start, start + 2):
            mismatched_noise += sum(a != b for a, b in zip(want, pick(neighbour)))
    # the check can see a draft drawn with a neighbouring position's noise: those picks differ often
    assert mismatched_noise >= 10


@pytest.mark.parametrize("fast", [False, True])
def test_a_draft_vocabulary_keeps_decoding_lossless(tmp_path, tiny_target_dir, fast):
    """Greedy and seeded sampling alike, on transformers' forward and on the fast path (whose LM head is a
    oneDNN-packed copy on a CPU: the draft head's rows come from the dense weight it keeps)."""
    from dflash_cli.engine.generate import generate

    folder = _drafter_with_vocab(tmp_path, torch.arange(0, VOCAB, 2))
    target = load_target(tiny_target_dir, device=DEVICE, dtype="float32")
    drafter = load_drafter(folder, device=DEVICE, dtype="float32")
    attach_drafter(target, drafter)
    if fast:
        assert target.enable_fast_path(256, pad_to=drafter.block_size) is None
        assert DEVICE != "cpu" or type(target.logits_head).__name__ == "PackedLinear"
    plain_target = load_target(tiny_target_dir, device=DEVICE, dtype="float32")
    for prompt in ([5, 9, 30, 41], [70, 71, 72, 3, 8, 100]):
        for sampling in ({}, {"temperature": 1.0, "seed": 11}):
            plain = generate(plain_target, None, prompt, max_new_tokens=40, stop_ids=[], **sampling)
            # full blocks: the adaptive controller would pause this random drafter (and, from the second request
            # on, may not re-probe it within 40 tokens), and then nothing drafted would be checked
            spec = generate(target, drafter, prompt, max_new_tokens=40, stop_ids=[], adaptive=False, **sampling)
            assert spec.tokens == plain.tokens, sampling
            assert spec.stats.drafted > 0


@pytest.mark.parametrize("ids, message", [
    (torch.tensor([1.0, 2.0]), "non-empty 1-D integer tensor, got float32"),
    (torch.tensor([[1, 2]]), "non-empty 1-D integer tensor"),
    (torch.tensor([], dtype=torch.int64), "non-empty 1-D integer tensor"),
    (torch.tensor([3, 2, 5]), "distinct token ids in increasing order"),
    (torch.tensor([2, 2, 5]), "distinct token ids in increasing order"),
    (torch.tensor([-1, 2]), f"ids outside the vocabulary [0, {VOCAB})"),
    (torch.tensor([2, VOCAB]), f"ids outside the vocabulary [0, {VOCAB})"),
])
def test_a_bad_draft_vocabulary_is_refused_by_name(tmp_path, ids, message):
    folder = _drafter_with_vocab(tmp_path, ids)
    with pytest.raises(CheckpointError, match="tensor 'draft_vocab'") as e:
        load_drafter(folder, device=DEVICE, dtype="float32")
    assert message in str(e.value)


def test_a_draft_vocabulary_is_for_v1_drafters_only(tmp_path):
    folder = _drafter_with_vocab(tmp_path, torch.arange(4, 20), dflash2_config(target_config("qwen3")))
    with pytest.raises(CheckpointError, match="DFlash v1 drafters only"):
        load_drafter(folder, device=DEVICE, dtype="float32")


def test_the_draft_vocabulary_round_trips_and_the_transformers_format_leaves_it_out(tmp_path):
    folder = _drafter_with_vocab(tmp_path, torch.tensor([4, 9, 30], dtype=torch.int32))
    drafter = load_drafter(folder, device=DEVICE, dtype="float32")
    assert drafter.draft_vocab is not None and drafter.draft_vocab.tolist() == [4, 9, 30]
    again = load_drafter(save_drafter(drafter, tmp_path / "again"), device=DEVICE, dtype="float32")
    assert again.draft_vocab is not None and again.draft_vocab.tolist() == [4, 9, 30]
    hf = load_drafter(save_drafter(drafter, tmp_path / "hf", format="transformers"), device=DEVICE, dtype="float32")
    assert hf.draft_vocab is None


# -- --init -------------------------------------------------------------------------------------------

def test_init_fine_tunes_the_given_drafter(tmp_path, tiny_target_dir):
    from dflash_cli.train.api import train_drafter

    cfg = drafter_config(target_config("qwen3"), layers=1, block_size=6, taps=(1, 4))
    cfg["dflash_config"]["mask_token_id"] = 151
    start = save_random_drafter(tmp_path / "start", cfg, seed=5)
    # lr 0: the weights written are the starting drafter's exactly, so they were loaded, not re-drawn
    out = train_drafter(tiny_target_dir, tmp_path / "out", prompts=PROMPTS[:4], init=start, steps=2, batch=2,
                        anchors=4, max_new_tokens=12, lr=0.0, device=DEVICE, dtype="float32").folder
    written, original = load_file(str(out / "model.safetensors")), load_file(str(start / "model.safetensors"))
    assert written.keys() == original.keys()
    for name in original:
        assert torch.equal(written[name], original[name]), name
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["block_size"] == 6
    assert config["dflash_config"]["target_layer_ids"] == [1, 4] and config["dflash_config"]["mask_token_id"] == 151
    assert config["training"]["init"] == str(start)


def test_init_can_change_the_block_size_keeping_every_weight(tmp_path, tiny_target_dir):
    from dflash_cli.train.api import train_drafter

    start = save_random_drafter(tmp_path / "start", drafter_config(target_config("qwen3"), block_size=8), seed=5)
    out = train_drafter(tiny_target_dir, tmp_path / "out", prompts=PROMPTS[:4], init=start, block_size=4, steps=2,
                        batch=2, anchors=4, max_new_tokens=12, lr=0.0, device=DEVICE, dtype="float32").folder
    written, original = load_file(str(out / "model.safetensors")), load_file(str(start / "model.safetensors"))
    assert written.keys() == original.keys() and all(torch.equal(written[n], original[n]) for n in original)
    config = json.loads((out / "config.json").read_text())
    assert config["dflash_config"]["block_size"] == 4 and config["training"]["block_size"] == 4
    assert load_drafter(out, device=DEVICE, dtype="float32").block_size == 4


def test_a_fine_tune_keeps_its_init_drafters_draft_vocabulary(tmp_path, tiny_target_dir):
    """A fine-tune on narrower data must not lose the ids its starting drafter drafted (the demo's round 5
    shrank 21,902 ids to 14,568 and lost on math and code): the new vocabulary is both sets."""
    from dflash_cli.train.api import train_drafter

    kept = torch.arange(VOCAB - 40, VOCAB, 3)  # ids a short reply run is unlikely to produce
    start = _drafter_with_vocab(tmp_path, kept)
    out = train_drafter(tiny_target_dir, tmp_path / "out", prompts=PROMPTS[:4], init=start, steps=1, batch=2,
                        anchors=4, max_new_tokens=12, draft_vocab=True, device=DEVICE, dtype="float32").folder
    vocab = load_drafter(out, device=DEVICE, dtype="float32").draft_vocab
    assert vocab is not None
    replies = set(vocab.tolist()) - set(kept.tolist())
    assert set(kept.tolist()) <= set(vocab.tolist()) and replies, "both the init's ids and the replies' ids"
    assert vocab.tolist() == sorted(set(vocab.tolist()))


def test_init_with_a_drafter_of_another_target_is_refused_before_any_weights(tmp_path, tiny_target_dir,
                                                                            monkeypatch):
    import dflash_cli.train.api as api
    from dflash_cli.engine.errors import DFlashError

    wide = target_config("qwen3", hidden_size=96)
    start = save_random_drafter(tmp_path / "start", drafter_config(wide), seed=5)
    monkeypatch.setattr(api, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    with pytest.raises(DFlashError, match="hidden"):
        api.train_drafter(tiny_target_dir, tmp_path / "out", prompts=PROMPTS[:4], init=start, steps=1,
                          device=DEVICE, dtype="float32")


def test_init_with_another_shape_is_one_clear_error(tmp_path, tiny_target_dir):
    from click.testing import CliRunner

    from dflash_cli.ui.cli import cli

    start = save_random_drafter(tmp_path / "start", drafter_config(target_config("qwen3"), layers=1), seed=5)
    result = CliRunner().invoke(cli, ["train", "-m", str(tiny_target_dir), "-o", str(tmp_path / "o"),
                                      "--init", str(start), "--layers", "3", "--device", DEVICE])
    assert result.exit_code != 0 and "--layers 3 differs from the --init drafter's 1" in result.output
    assert "Traceback" not in result.output


def test_a_zero_generation_budget_trains_on_the_stored_answers_only(tmp_path, tiny_target_dir):
    from click.testing import CliRunner

    from dflash_cli.train.data import read_index
    from dflash_cli.ui.cli import cli

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    common = ["train", "-m", str(tiny_target_dir), "-o", str(tmp_path / "o"), "--prompts", str(prompts),
              "--block-size", "4", "--anchors", "4", "--max-new-tokens", "8", "--gen-batch", "2", "--batch", "2",
              "--device", DEVICE, "--dtype", "float32"]
    first = CliRunner().invoke(cli, [*common, "--steps", "1", "--gen-budget", "0.0001"])
    assert first.exit_code == 0, first.output
    answered = {i for s in read_index(tmp_path / "o" / "data")["shards"] for i in s["prompts"]}
    assert 0 < len(answered) < len(PROMPTS)  # one batch: the budget is checked between batches
    second = CliRunner().invoke(cli, [*common, "--steps", "2", "--gen-budget", "0"])
    assert second.exit_code == 0, second.output
    assert {i for s in read_index(tmp_path / "o" / "data")["shards"] for i in s["prompts"]} == answered
    assert json.loads((tmp_path / "o" / "config.json").read_text())["training"]["step"] == 2


def test_a_zero_generation_budget_with_nothing_stored_says_so(tmp_path, tiny_target_dir):
    from click.testing import CliRunner

    from dflash_cli.ui.cli import cli

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    result = CliRunner().invoke(cli, ["train", "-m", str(tiny_target_dir), "-o", str(tmp_path / "o"), "--prompts",
                                      str(prompts), "--steps", "1", "--gen-budget", "0", "--device", DEVICE,
                                      "--dtype", "float32"])
    assert result.exit_code == 2
    assert f"no stored replies in {tmp_path / 'o' / 'data'} to train on" in result.output
    assert "give it minutes to generate some" in result.output and "Traceback" not in result.output
