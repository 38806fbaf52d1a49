"""Thinking in miniature: the splitter check over every chunking, a `<think>` tokenizer, a bigram target."""

from __future__ import annotations

import random

import torch
from conftest import VOCAB, target_config

from dflash_cli.engine.text import THINK_TAGS
from dflash_cli.engine.thinking import ThinkingSplitter

OPENS = "{% else %}<think>"  # Qwen3.5: thinking on opens <think> in the prompt
THINKING_TEMPLATE = (
    "{% for m in messages %}{% set content = m['content'] %}"
    "{% if m['role'] == 'assistant' %}{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think></think>"
    + OPENS + "{% endif %}{% endif %}")


def stream(text: str, cuts: list[int], inside: bool = False, markers=THINK_TAGS) -> list[tuple[bool, str]]:
    splitter = ThinkingSplitter(inside, markers)
    bounds = [0, *cuts, len(text)]
    segments = [seg for a, b in zip(bounds, bounds[1:]) for seg in splitter.feed(text[a:b])]
    return segments + splitter.flush()


def parts(segments) -> tuple[str, str]:
    return ("".join(s for t, s in segments if t), "".join(s for t, s in segments if not t))


def assert_split_at_every_chunking(text, inside, thinking, answer, markers):
    """Every split into two chunks, one character a chunk, and random 5-chunk splits: the same parts."""
    for cut in range(len(text) + 1):
        assert parts(stream(text, [cut], inside, markers)) == (thinking, answer), cut
    assert parts(stream(text, list(range(1, len(text))), inside, markers)) == (thinking, answer)
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 4)))
        segments = stream(text, cuts, inside, markers)
        assert "".join(s for _, s in segments) == text and parts(segments) == (thinking, answer)


def save_thinking_tokenizer(folder, opens: bool):
    """The char-level tokenizer of conftest plus `<think>` and `</think>` as single (non-special) tokens,
    as in Qwen's vocabulary, and a Qwen-like template with `enable_thinking`; `opens`: thinking on opens
    `<think>` in the prompt (Qwen3.5), else the model writes it (Qwen3)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>", "<think>", "</think>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    vocab.update({f"<extra_{i}>": i for i in range(len(vocab), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.chat_template = THINKING_TEMPLATE.replace(OPENS, OPENS if opens else "")
    fast.save_pretrained(folder)
    return fast


def save_bigram_target(folder, tok, chain: list[str]):
    """A bigram model saved in `folder` with `tok`: each token of `chain` is followed by the next (the last
    ends the reply). Each chain token's embedding is a basis vector, and the lm_head row of the token that
    must follow it points along that vector; attention and MLP add nothing. The chain's tokens must differ."""
    from transformers import AutoConfig, AutoModelForCausalLM

    ids = [tok.convert_tokens_to_ids(t) for t in chain]
    assert len(set(ids)) == len(ids) and tok.unk_token_id not in ids, chain
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**target_config("qwen3")), dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        for k, (token, nxt) in enumerate(zip(ids, ids[1:])):
            embed[token] = 0
            embed[token, k] = 1.0
            head[nxt, k] += 100.0
    model.save_pretrained(folder)
    return folder
