"""Tiny in-memory tokenizers trained on a small multilingual corpus: byte-level BPE and Metaspace BPE."""

from __future__ import annotations

import json

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]

CORPUS = [
    "Hello world, this is a small corpus for a tiny tokenizer.",
    "Crème brûlée, café, naïve façade, jalapeño, Ångström, Øresund, Straße.",
    "Ελληνικά γράμματα και русский текст тоже здесь.",
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "日本語のテキスト：こんにちは、元気ですか？",
    "한국어 문장도 조금 있습니다.",
    "Emoji time 😀🎉👍🏽🚀 and a family 👨‍👩‍👧 plus flags 🇫🇷🇯🇵.",
    "Math: ∑ x² ≤ ∞, arrows → ← ↔, currency € £ ¥ ₹.",
    "   leading spaces,  double  spaces and\nnew lines\n\ttabs too.",
]


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2/Qwen-style byte-level BPE; the small vocab leaves many characters split over several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<s>")


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """Llama/SentencePiece-style BPE: Metaspace ("▁" leading spaces) plus <0xXX> byte fallback."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=300, limit_alphabet=60, special_tokens=["<unk>", *SPECIALS], show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):  # byte tokens live in the model vocab, as in Llama's tokenizer.json
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    data["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(data))
    tok.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<s>", unk_token="<unk>")
