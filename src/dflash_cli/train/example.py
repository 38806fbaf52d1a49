"""One training example: a prompt and the target's answer, with what the target computed on the way."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Example:
    ids: torch.Tensor  # (L,) prompt + response token ids
    features: torch.Tensor  # (L-1, n_taps*H) tapped states of every token fed to the target (not the last)
    prompt_len: int
    # (L - prompt_len, k): the target's k most likely ids at each response position and their log-probs;
    # row r is the distribution the response's token r was chosen from. None without top-k data.
    top_ids: torch.Tensor | None = None
    top_logp: torch.Tensor | None = None
