"""Token selection: greedy at temperature 0, else temperature + top-k + top-p sampling."""

from __future__ import annotations

import ctypes
import secrets

import torch

from dflash_cli.engine.cpu import native
from dflash_cli.engine.errors import InvalidSettingError


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    if temperature < 0:
        raise InvalidSettingError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise InvalidSettingError(f"top-p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise InvalidSettingError(f"top-k must be >= 0 (0 = off), got {top_k}")


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum over the last dimension (torch.argmax's choice), in fp32 (a CPU argmax over
    bf16 is several times slower): CPU rows through the C kernels when this process loaded them (torch's CPU
    argmax took 80 us for one row of a 49k vocabulary, of a 4-5 ms decode)."""
    logits = logits.float()
    lib = _native_for(logits)
    picked = native.argmax_rows(lib, logits) if lib is not None else None
    return picked if picked is not None else logits.argmax(dim=-1)


def _native_for(logits: torch.Tensor) -> ctypes.CDLL | None:
    """The loaded C kernels where they take these fp32 logits (CPU rows of unit stride), else None."""
    built = native.loaded() if logits.device.type == "cpu" and logits.dim() == 2 else None
    ok = built is not None and logits.stride(-1) == 1 and logits.shape[-1] > 0
    return built.lib if ok and built is not None else None


def greedy_ids_with_confidence(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """greedy_ids, and each row's softmax probability of its greedy token (float32): how sure a drafter is of
    its draft, which for a trained drafter is close to how often the target accepts it (0 for a row of NaN or
    infinite logits, where it cannot tell)."""
    logits = logits.float()
    lib = _native_for(logits)
    picked = native.argmax_confidence_rows(lib, logits) if lib is not None else None
    if picked is None:
        picked = logits.argmax(dim=-1), (logits.amax(dim=-1) - torch.logsumexp(logits, dim=-1)).exp()
    ids, top = picked
    return ids, torch.where(top.isfinite(), top.clamp(0.0, 1.0), 0.0)


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """(T, V) probabilities after temperature, top-k, then top-p (nucleus) filtering."""
    scores = logits.float() / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


class Sampler:
    """Picks one token per row of logits; the random draw for absolute position p depends only on (seed, p).

    Sampling is Gumbel-max (argmax of log p + Gumbel noise, an exact draw from p) with the noise of position
    p generated from (seed, p) alone. So however the positions are grouped into verify blocks (adaptive
    block sizes, plain decoding), a seed gives the same tokens, and a seeded run replays exactly.
    """

    constrained = False  # engine/constraint.py's ConstrainedSampler masks every row by a grammar

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None):
        check_sampling(temperature, top_p, top_k)
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.greedy = temperature == 0 or top_k == 1
        self.seed = seed if seed is not None else secrets.randbits(62)

    def __call__(self, logits: torch.Tensor, position: int = 0) -> torch.Tensor:
        """logits (T, V) of the tokens at positions position..position+T-1 -> token ids (T,), on their device."""
        if self.greedy:
            return greedy_ids(logits)
        probs = sampling_probs(logits, self.temperature, self.top_p, self.top_k)
        return (probs.log() + self.gumbel(position, probs.shape[0], probs.shape[-1], probs.device)).argmax(dim=-1)

    def verify(self, logits: torch.Tensor, position: int, drafts: torch.Tensor) -> torch.Tensor:
        """The target's choice at every slot of a verify block fed [anchor, drafts] (logits (n, V))."""
        return self(logits, position)

    def advance(self, tokens: list[int]) -> None:
        """Told the tokens each round committed (a grammar follows them; plain sampling needs nothing)."""

    def gumbel(self, position: int, rows: int, size: int, device: torch.device) -> torch.Tensor:
        """(rows, size) Gumbel noise of positions position..position+rows-1: what __call__ adds to log p there.

        A drafter that adds the same noise to its own log q proposes an exact sample of q that is coupled to
        the target's draw (docs/engine.md, "Sampling: why coupled drafts").
        """
        uniform = torch.stack([self.uniform(position + i, size, device) for i in range(rows)])
        return -torch.log(-torch.log(uniform))

    def uniform(self, position: int, size: int, device: torch.device) -> torch.Tensor:
        """The (size,) uniforms of absolute position `position`, a function of (seed, position) only."""
        generator = torch.Generator(device=device)
        generator.manual_seed((self.seed * 0x9E3779B97F4A7C15 + position) % (1 << 63))
        return torch.rand(size, generator=generator, device=device).clamp_(min=1e-20)
