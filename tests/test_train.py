"""Drafter training: the batched block mask matches inference, training lowers the loss, runs resume."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, VOCAB, drafter_config, save_random_drafter, target_config

from dflash_cli.engine.load import attach_drafter, load_drafter, load_target
from dflash_cli.train.forward import block_ids, block_labels, training_forward


@pytest.mark.parametrize("layer_kind", ["full", "sliding"])
def test_training_mask_gives_inference_logits(tmp_path, tiny_target_dir, layer_kind):
    tcfg = target_config("qwen3")
    extra = {}
    if layer_kind == "sliding":  # one causal windowed layer (window < context) and one full layer
        extra = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    dcfg = drafter_config(tcfg, block_size=5, **extra)
    drafter = load_drafter(save_random_drafter(tmp_path / "d", dcfg, seed=3), device=DEVICE, dtype="float32")
    target = load_target(tiny_target_dir, device=DEVICE, dtype="float32")
    attach_drafter(target, drafter)
    torch.manual_seed(0)
    ids = torch.randint(3, 140, (2, 23), device=DEVICE)
    feats = torch.cat([target.forward(row[None], target.new_cache(), 0, taps=True)[1] for row in ids])
    anchors = torch.tensor([[3, 10, 17, 21], [1, 7, 12, 20]], device=DEVICE)
    bsz = drafter.block_size
    emb = F.embedding(block_ids(ids, anchors, bsz, drafter.mask_token_id), target.embed_weight)
    with torch.no_grad():
        h = training_forward(drafter, feats, emb, anchors)
        train_logits = target.lm_head(h).view(2, 4, bsz, -1)
    for n in range(2):
        for a, p in enumerate(anchors[n].tolist()):
            block = torch.tensor([ids[n, p].item()] + [drafter.mask_token_id] * (bsz - 1), device=DEVICE)
            cache = drafter.new_cache()
            with torch.no_grad():
                ref = target.lm_head(drafter(feats[n : n + 1, :p], F.embedding(block, target.embed_weight)[None],
                                             p, cache))[0]
            torch.testing.assert_close(train_logits[n, a], ref, atol=1e-4, rtol=1e-4)


def test_a_drafter_config_for_every_target_family():
    """The drafter `train` shapes for a target: its sizes from the target's text config, also where a mixture
    of experts names no dense MLP size (Qwen3.5-MoE) and under a multimodal wrapper."""
    from conftest import hybrid_config
    from transformers import AutoConfig

    from dflash_cli.engine.hf_config import DrafterConfig
    from dflash_cli.train.shape import drafter_config as shaped

    moe = hybrid_config(moe=True)
    del moe["text_config"]["intermediate_size"]  # as Qwen3.5-35B-A3B's published config: experts' sizes only
    cases = ((target_config("qwen3"), 128, 6), (hybrid_config(), 128, 4), (moe, 3 * 64, 4))
    for cfg, mlp, layers in cases:
        raw = shaped(AutoConfig.for_model(**cfg), layers=2, block_size=8, taps=[1, 2], mask_id=5, vocab_rows=VOCAB)
        drafter = DrafterConfig.from_dict(raw)
        assert (raw["hidden_size"], raw["intermediate_size"], drafter.block_size) == (64, mlp, 8)
        assert raw["num_target_layers"] == layers


def test_block_labels_shift_and_end():
    ids = torch.arange(10)[None] + 100
    labels = block_labels(ids, torch.tensor([8]), torch.tensor([[2, 6]]), 4)
    assert labels.tolist() == [[[-100, 103, 104, 105], [-100, 107, -100, -100]]]


PROMPTS = [f"prompt {i}: tell me about {w}" for i, w in enumerate("cats dogs rain sun code math tea wind".split())]


def _train(target_dir, out, steps, events=None):
    from dflash_cli.train.api import train_drafter

    def record(kind, info):
        if events is not None:
            events.append((kind, info))

    return train_drafter(target_dir, out, prompts=PROMPTS, layers=2, block_size=8, steps=steps, batch=4,
                         anchors=8, max_new_tokens=40, eval_every=10, checkpoint_every=10, lr=1e-3,
                         device=DEVICE, dtype="float32", on_progress=record).folder


def test_train_lowers_loss_and_writes_a_loadable_lossless_drafter(tmp_path, tiny_target_dir):
    from dflash_cli.engine.generate import generate
    from dflash_cli.engine.load import load_pair

    events = []
    out = _train(tiny_target_dir, tmp_path / "out", 40, events)
    losses = [p.loss for kind, p in events if kind == "train"]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
    config = json.loads((out / "config.json").read_text())
    assert config["training"]["steps"] == 40 and config["dflash_config"]["mask_token_id"] >= 0
    window = config["dflash_config"]["draft_window"]  # the median training sequence, up to a power of two
    assert window >= 64 and window & (window - 1) == 0
    pair = load_pair(tiny_target_dir, out, device=DEVICE, dtype="float32")  # load_drafter + attach_drafter
    assert getattr(pair.drafter, "context_window") == window
    target_only = load_target(tiny_target_dir, device=DEVICE, dtype="float32")
    for prompt in ([5, 9, 30, 41], [70, 71, 72, 3, 8, 100]):
        plain = generate(target_only, None, prompt, max_new_tokens=30, stop_ids=[])
        spec = generate(pair.target, pair.drafter, prompt, max_new_tokens=30, stop_ids=[])
        assert spec.tokens == plain.tokens


def test_train_drafter_takes_a_config_and_returns_what_it_wrote(tmp_path, tiny_target_dir):
    from dflash_cli.engine.errors import InvalidSettingError
    from dflash_cli.train import TrainConfig, train_drafter

    with pytest.raises(InvalidSettingError, match="--batch must be at least 1, got 0"):
        train_drafter(tiny_target_dir, tmp_path / "bad", prompts=PROMPTS, batch=0)
    assert not (tmp_path / "bad").exists()
    config = TrainConfig(layers=1, block_size=4, steps=2, batch=2, anchors=4, max_new_tokens=12, eval_every=1)
    out = tmp_path / "out"  # keyword options replace the config's
    result = train_drafter(tiny_target_dir, out, config, prompts=PROMPTS, steps=3, device=DEVICE, dtype="float32")
    training = json.loads((out / "config.json").read_text())["training"]
    assert result.folder == out and result.step == training["step"] == training["steps"] == 3
    assert training["layers"] == 1 and training["block_size"] == 4 and training["batch"] == 2
    for name in ("saved_step", "heldout_tau", "heldout_tau_by_set", "final_loss", "train_seconds",
                 "train_sequences", "heldout_sequences"):
        assert getattr(result, name) == training[name], name
    assert result.heldout_tau is not None and result.heldout_sequences == 1  # 8 prompts: the last is held out
    assert json.loads((out / "training_log.json").read_text())["wall_seconds"] == result.wall_seconds


def test_train_config_is_where_every_value_is_checked():
    from dflash_cli.engine.errors import InvalidSettingError
    from dflash_cli.train.config import TrainConfig

    for options, message in [(dict(batch=0), "--batch must be at least 1, got 0"),
                             (dict(block_size=1), "--block-size must be at least 2, got 1"),
                             (dict(time_budget=0.0), "--time-budget must be more than 0, got 0.0"),
                             (dict(gen_time_budget=-1.0), "--gen-budget must be at least 0, got -1.0"),
                             (dict(lr=float("nan")), "--lr must be a finite number, got nan"),
                             (dict(distill=1.5), "--distill must be between 0 and 1, got 1.5"),
                             (dict(gamma=0.0), "gamma must be more than 0, got 0.0"),
                             (dict(steps=10, time_budget=60.0), "give --steps or --time-budget, not both"),
                             (dict(distill=0.5), "--distill needs the target's top-k distributions"),
                             (dict(draft_vocab=True, sub_vocab=False), "--draft-vocab needs the training vocabulary"),
                             (dict(drafter_format="gguf"), "unknown drafter format 'gguf'")]:
        with pytest.raises(InvalidSettingError, match=re.escape(message)):
            TrainConfig(**options)
    assert TrainConfig().total_steps == 1000 and TrainConfig(time_budget=60.0).total_steps is None
    assert TrainConfig().warmup_steps == 50 and TrainConfig(steps=40).warmup_steps == 2
    assert TrainConfig(taps=(1, 4)).taps == [1, 4]


def test_cli_train_takes_its_defaults_and_ranges_from_train_config():
    from dataclasses import fields

    from dflash_cli.train.config import TrainConfig, bound
    from dflash_cli.ui.train_cmd import train

    config = {f.name: f for f in fields(TrainConfig)}
    shared = [p for p in train.params if p.name in config]
    assert len(shared) == 17
    for param in shared:
        assert param.default == config[param.name].default, param.name
        if "bound" in config[param.name].metadata:
            b = bound(param.name)
            assert (param.type.min, param.type.max, param.type.min_open) == (b.low, b.high, b.low_open), param.name


CHECKPOINT_PATH = "checkpoint/latest.safetensors"


def test_output_folders_that_would_mislead_or_overwrite_are_refused_before_loading(tmp_path, tiny_target_dir):
    import shutil

    from dflash_cli.engine.errors import InvalidSettingError
    from dflash_cli.train.api import train_drafter

    def train(out, **kw):
        return train_drafter(tiny_target_dir, out, prompts=PROMPTS, layers=2, block_size=8, steps=1, batch=2,
                             device=DEVICE, dtype="float32", **kw)

    with pytest.raises(InvalidSettingError, match=r"has 6 layers \(0..5\), so \[99\] cannot be tapped"):
        train(tmp_path / "taps", taps=[1, 99])
    assert not (tmp_path / "taps").exists()  # found before anything was written
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(InvalidSettingError, match="cannot create the output folder"):
        train(blocker / "out")
    downloaded = tmp_path / "downloaded"
    downloaded.mkdir()
    (downloaded / "config.json").write_text("{}")
    (downloaded / "model.safetensors").write_bytes(b"not ours")
    with pytest.raises(InvalidSettingError, match="already holds a model that no train run wrote"):
        train(downloaded)
    assert (downloaded / "model.safetensors").read_bytes() == b"not ours"
    # data another target generated: resuming on it would label the drafter with the wrong target
    out = _train(tiny_target_dir, tmp_path / "out", 2)
    other = tmp_path / "other-target"
    shutil.copytree(tiny_target_dir, other)
    with pytest.raises(InvalidSettingError, match="holds training data that .* generated, not"):
        train_drafter(other, out, prompts=PROMPTS, layers=2, block_size=8, steps=3, device=DEVICE, dtype="float32")
    # and everything written gets an ordinary file's mode (safetensors alone writes 0600)
    from dflash_cli.engine.files import umask_mode

    for path in [out / "model.safetensors", *(out / "data").glob("*.safetensors"), out / CHECKPOINT_PATH]:
        assert path.stat().st_mode & 0o777 == umask_mode(), path


def test_train_resumes_from_checkpoint_without_regenerating(tmp_path, tiny_target_dir, monkeypatch):
    import dflash_cli.train.data as data

    out = _train(tiny_target_dir, tmp_path / "out", 10)
    shards = sorted(p.name for p in (out / "data").glob("*.safetensors"))
    calls = []
    original = data.generate_batch
    monkeypatch.setattr(data, "generate_batch", lambda *a, **k: calls.append(1) or original(*a, **k))
    events = []
    _train(tiny_target_dir, out, 20, events)
    steps = [p.step for kind, p in events if kind == "train"]
    assert steps == list(range(11, 21))
    assert calls == [] and not [k for k, _ in events if k == "data"]
    assert sorted(p.name for p in (out / "data").glob("*.safetensors")) == shards
    log = json.loads((out / "training_log.json").read_text())
    assert len(log["losses"]) == 20
    assert json.loads((out / "config.json").read_text())["training"]["step"] == 20


@pytest.mark.parametrize("fmt", ["dflash", "transformers"])
def test_cli_train_writes_a_drafter(tmp_path, tiny_target_dir, fmt):
    from click.testing import CliRunner

    from dflash_cli.ui.cli import cli

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS[:5]) + "\n")
    result = CliRunner().invoke(cli, ["train", "-m", str(tiny_target_dir), "-o", str(tmp_path / "d"),
                                      "--prompts", str(prompts), "--steps", "3", "--block-size", "4",
                                      "--anchors", "4", "--max-new-tokens", "12", "--device", DEVICE,
                                      "--dtype", "float32", "--taps", "1,4", "--format", fmt])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    taps = config["dflash_config"]["target_layer_ids"] if fmt == "dflash" else config["target_layer_ids"]
    assert taps == [1, 4] and config["training"]["step"] == 3
    # not a terminal: plain log lines instead of a live bar
    assert "generated 5/5 replies" in result.stderr
    assert re.search(r"^step 3 loss \d+\.\d+ tau~\d\.\d\d \d+ tok/s, \d+\.\d min$", result.stderr, re.M)
    assert (config["model_type"] == "muse_glimmer_assistant") == (fmt == "transformers")
    drafter = load_drafter(tmp_path / "d", device=DEVICE, dtype="float32")
    assert drafter.config.source_format == fmt


def test_best_heldout_checkpoint_is_the_drafter_written(tmp_path, tiny_target_dir, monkeypatch):
    from safetensors.torch import load_file

    import dflash_cli.train.trainer as trainer

    # (held-out loss, tau) at steps 10, 20, 30
    scripted = iter(trainer.Estimate(loss, tau, {}) for loss, tau in [(0.5, 1.5), (0.4, 2.5), (0.45, 2.0)])
    monkeypatch.setattr(trainer, "evaluate", lambda *a, **k: next(scripted))
    out = _train(tiny_target_dir, tmp_path / "out", 30)
    training = json.loads((out / "config.json").read_text())["training"]
    assert training["saved_step"] == 20 and training["heldout_tau"] == 2.5 and training["last_heldout_tau"] == 2.0
    best = load_file(str(out / "checkpoint" / "best.safetensors"))
    last = {k.removeprefix("drafter."): v for k, v in load_file(str(out / "checkpoint" / "latest.safetensors")).items()
            if k.startswith("drafter.")}
    written = load_file(str(out / "model.safetensors"))
    compared = [name for name in best if name in written and best[name].dim() > 1]
    assert compared
    for name in compared:
        torch.testing.assert_close(written[name].float(), best[name].float())
    assert any(not torch.equal(best[n], last[n]) for n in compared)  # step 20's weights, not step 30's


def test_best_weights_of_another_step_are_not_used(tmp_path, tiny_target_dir, monkeypatch):
    import dflash_cli.train.trainer as trainer

    scripted = iter(trainer.Estimate(loss, tau, {}) for loss, tau in [(0.5, 1.5), (0.4, 2.5), (0.45, 2.0)])
    monkeypatch.setattr(trainer, "evaluate", lambda *a, **k: next(scripted))
    out = _train(tiny_target_dir, tmp_path / "out", 30)
    # as if a run had stopped after saving newer best weights but before the checkpoint that records them
    best = out / "checkpoint" / "best.safetensors"
    from safetensors.torch import load_file, save_file

    save_file(load_file(str(best)), str(best), metadata={"step": "25"})
    monkeypatch.setattr(trainer, "evaluate", lambda *a, **k: trainer.Estimate(0.44, 2.1, {}))
    out = _train(tiny_target_dir, out, 31)
    training = json.loads((out / "config.json").read_text())["training"]
    assert training["saved_step"] == 31 and training["heldout_tau"] == 2.1  # the last weights, labelled as such


def test_a_checkpoint_with_estimates_of_another_kind_reports_none_of_them(tmp_path, tiny_target_dir):
    out = _train(tiny_target_dir, tmp_path / "out", 10)
    meta_path = out / "checkpoint" / "latest.safetensors.json"
    meta = json.loads(meta_path.read_text())
    # as a checkpoint written before the replay estimate: 3-value evals on the bare held-out ids
    meta["state"]["heldout_key"] = meta["state"]["heldout_key"].split(":", 1)[1]
    meta["state"]["evals"], meta["state"]["best"] = [[10, 0.5, 1.19]], [10, 0.5, 1.19]
    meta_path.write_text(json.dumps(meta))
    training = json.loads((_train(tiny_target_dir, out, 10) / "config.json").read_text())["training"]
    assert training["heldout_tau"] is None and training["last_heldout_tau"] is None  # no step, no estimate
    out = _train(tiny_target_dir, out, 20)
    training = json.loads((out / "config.json").read_text())["training"]
    evals = json.loads((out / "training_log.json").read_text())["evals"]
    assert [e[0] for e in evals] == [20] and training["heldout_tau"] == evals[0][2] != 1.19


def test_generation_budget_stops_between_batches_and_a_later_run_finishes(tmp_path, tiny_target_dir):
    import time

    from transformers import AutoTokenizer

    from dflash_cli.train.data import build_dataset, load_dataset

    target = load_target(tiny_target_dir, device=DEVICE, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_target_dir))
    prompts = [f"question {i}: " + "why " * (40 - i) for i in range(40)]  # a global length sort starts at 39
    slow = lambda *args: time.sleep(0.05)  # noqa: E731 - one batch always outlasts the budget
    first = build_dataset(target, tokenizer, prompts, [1, 4], tmp_path / "data", max_new_tokens=6, batch_size=2,
                          time_budget=0.01, on_progress=slow)
    assert len(first) == 2 and all(i < 16 for i in first)  # the first window of the list goes first
    rest = build_dataset(target, tokenizer, prompts, [1, 4], tmp_path / "data", max_new_tokens=6, batch_size=2)
    assert rest == list(range(40))
    assert len(load_dataset(tmp_path / "data")) == 40


def test_demo_prompt_set_is_varied_reproducible_and_apart_from_the_bench_sets():
    from dflash_cli.prompts.reader import BUILTIN_SETS, load_prompt_set
    from dflash_cli.train.prompts.demo import demo_prompts

    prompts = demo_prompts(3000)
    assert prompts == demo_prompts(3000) and len(set(prompts)) == 3000
    assert demo_prompts(100) == prompts[:100]
    bench = {p.prompt for name in BUILTIN_SETS for p in load_prompt_set(name)}
    assert len(bench) >= 100 and not bench & set(prompts)
    math = sum(any(c.isdigit() for c in p) for p in prompts)
    code = sum(any(w in p for w in ("function", "code", "program")) for p in prompts)
    chat = len(prompts) - math - code
    assert math > 1500 and code > 600 and chat > 300
    first_words = {" ".join(p.split()[:3]) for p in prompts}
    assert len(first_words) > 300


@pytest.fixture(scope="module")
def mix_30000():
    from dflash_cli.train.prompts.mix import mix_prompts_with_categories

    return mix_prompts_with_categories(30000)


def test_mix_prompt_set_is_reproducible_a_prefix_family_and_apart_from_the_bench_sets(mix_30000):
    from dflash_cli.prompts.reader import BUILTIN_SETS, load_prompt_set
    from dflash_cli.train.prompts.mix import mix_prompts, mix_prompts_with_categories

    prompts = [p for _, p in mix_30000]
    assert len(set(prompts)) == 30000
    assert mix_prompts(3000) == prompts[:3000] == mix_prompts(3000, seed=0)
    assert mix_prompts(100) == prompts[:100] and mix_prompts(100, seed=1) != prompts[:100]
    assert [c for c, _ in mix_prompts_with_categories(500)] == [c for c, _ in mix_30000[:500]]
    bench = {p.prompt for name in BUILTIN_SETS for p in load_prompt_set(name)}
    assert len(bench) >= 100 and not bench & set(prompts)
    assert all(p.isascii() and 10 < len(p) < 400 for p in prompts)


@pytest.mark.parametrize("n", [3000, 12000, 30000])
def test_mix_prompt_set_keeps_40_30_30_at_every_size_and_varied_code_and_chat(mix_30000, n):
    from collections import Counter

    head = mix_30000[:n]
    shares = Counter(c for c, _ in head)
    for cat, want in (("math", 0.40), ("code", 0.30), ("chat", 0.30)):
        assert abs(shares[cat] / n - want) < 0.025, (cat, shares[cat] / n)
    for cat, least in (("code", 60), ("chat", 100)):
        openings = {" ".join(p.split()[:3]) for c, p in head if c == cat}
        assert len(openings) >= least, (cat, len(openings))
    code = [p for c, p in head if c == "code"]
    for marker in ("SQL", "regular expression", "In Bash", "class called", "What does this Python code"):
        assert sum(marker in p for p in code) >= 15, marker
    chat = [p for c, p in head if c == "chat"]
    for marker in ("email", "recipe", "Translate into", "pros and cons", "review positive"):
        assert sum(marker in p for p in chat) >= 15, marker


def test_prompts_spec_file_set_and_error(tmp_path):
    from dflash_cli.engine.errors import InvalidSettingError
    from dflash_cli.train.prompts import resolve_prompts
    from dflash_cli.train.prompts.default import DEFAULT_PROMPTS
    from dflash_cli.train.prompts.demo import demo_prompts
    from dflash_cli.train.prompts.mix import mix_prompts

    f = tmp_path / "p.txt"
    f.write_text("one\n\ntwo\n")
    assert resolve_prompts(str(f)) == ["one", "two"]
    assert resolve_prompts("demo:25") == demo_prompts(25)
    assert len(resolve_prompts("demo")) == 6000
    assert resolve_prompts("mix:50") == mix_prompts(50) and len(resolve_prompts("mix:50")) == 50
    assert resolve_prompts(None) == list(DEFAULT_PROMPTS)
    for bad in ("nope", "demo:x", "demo:0", "demo:²", "mix:0", "mix:-3", str(tmp_path / "missing.txt")):
        with pytest.raises(InvalidSettingError, match="no prompt file or built-in prompt set"):
            resolve_prompts(bad)


@pytest.mark.parametrize("fast", [False, True])
def test_training_features_are_the_taps_decoding_reads(tiny_target_dir, fast):
    """The tapped states stored as training data equal what Target.forward(..., taps=True) gives the drafter
    on the same tokens, the last layer's (after the final norm) included, padded prompts too."""
    from dflash_cli.train.data import generate_batch

    target = load_target(tiny_target_dir, device=DEVICE, dtype="float32")
    taps = [4, 1, target.num_layers - 1]  # not sorted: the drafter's concatenation order counts
    examples = generate_batch(target, [[5, 9, 14, 3, 22, 7], [11, 4, 30]], taps, max_new_tokens=6, stop_ids=[],
                              pad_id=0)
    target.set_taps(taps)
    if fast:
        assert target.enable_fast_path(64) is None
    for ex in examples:
        ids = ex.ids[:-1][None].to(DEVICE)
        _, hidden = target.forward(ids, target.new_cache(), 0, taps=True)
        assert ex.features.shape == hidden[0].shape
        torch.testing.assert_close(ex.features.float(), hidden[0].to(torch.bfloat16).float().cpu(), atol=2e-2,
                                   rtol=2e-2)


def test_a_new_drafters_window_is_its_median_training_sequence_up_to_a_power_of_two():
    from dflash_cli.train.shape import draft_window_for

    assert draft_window_for([]) == draft_window_for([3, 9]) == 64  # at least 64
    assert draft_window_for([10, 70, 300]) == 128 and draft_window_for([64, 64, 5000]) == 64
    assert draft_window_for([65, 65, 65]) == 128 and draft_window_for([250, 5000, 6000, 7000]) == 8192
