"""Plain autoregressive decoding through the same target path, cache and sampler as speculation."""

from __future__ import annotations

import time
from collections.abc import Iterator

from dflash_cli.engine.device import Stopwatch
from dflash_cli.engine.sampling import Sampler
from dflash_cli.engine.speculative import Round
from dflash_cli.engine.state import DecodeState


def baseline_rounds(state: DecodeState, sample: Sampler, *, limit: int) -> Iterator[Round]:
    """Yields one Round (one token) per target forward until len(state.tokens) reaches `limit`."""
    target = state.target
    taps = state.drafter is not None  # keep the drafter's context complete if speculation resumes later
    watch = Stopwatch(target.device)
    while len(state.tokens) < limit:
        t0 = time.perf_counter()
        state.check_caches()
        watch.start()
        assert state.anchor is not None  # the caller committed the first token
        logits, hidden = target.forward(state.anchor[None], state.target_cache, state.start, taps=taps)
        choice = sample(logits, state.start + 1)  # (1,) the token at position start+1
        token = choice.tolist()  # the step's one host-device sync
        watch.stop()
        state.commit(token, hidden, anchor=choice)
        sample.advance(token)
        yield Round(token, 0, 0, 0.0, watch.seconds, time.perf_counter() - t0)
