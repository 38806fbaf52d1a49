"""What a draft vocabulary saves: one draft with the LM head over the whole vocabulary vs its rows only.

Loads a pair as the CLI does (fast path, this machine's default dtype), prefills a real prompt, then
times the same draft call (the trained block, keeping K drafts) alternately with and without the
drafter's `draft_vocab`, and how often the greedy drafts agree. The drafter must carry a draft
vocabulary (`train --draft-vocab`), or `--vocab-from DIR` lends it the one of another drafter folder.

    python benchmarks/draft_vocab.py -m demo --draft ./new-drafter --keep 15 4 --repeats 40
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dflash_cli
from dflash_cli.engine.device import synchronize


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", default="demo")
    p.add_argument("--draft", default=None, help="drafter folder (default: the model's own)")
    p.add_argument("--vocab-from", default=None, help="take draft_vocab from this drafter folder")
    p.add_argument("--keep", type=int, nargs="+", default=[15, 4], help="drafts kept per block")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    runtime = dflash_cli.load(args.model, args.draft)
    target, drafter = runtime.target, runtime.drafter
    assert drafter is not None, "the model has no drafter"
    if args.vocab_from:
        from dflash_cli.engine.load import load_drafter

        drafter.draft_vocab = load_drafter(args.vocab_from, device="cpu", dtype=torch.float32).draft_vocab
    vocab = drafter.draft_vocab
    if vocab is None:
        raise SystemExit("this drafter has no draft_vocab: train it with --draft-vocab, or pass --vocab-from")
    from dflash_cli.api import prompt_ids

    ids = prompt_ids(runtime, "Explain how a hash table works, then write one in Python.")
    cache = target.new_cache()
    _, hidden = target.forward(torch.tensor([ids], device=target.device), cache, 0, taps=True)
    context = len(ids) - 4  # each timed draft adds the last 4 context rows, then rolls them back
    dcache = drafter.new_cache()
    anchor = torch.tensor(ids[-1:], device=target.device)
    head = target.logits_head
    drafter.draft(hidden[:, :context], anchor, context, 2, dcache, target.embed_table, head)

    def one(keep: int, with_vocab: bool) -> tuple[float, list[int]]:
        drafter.draft_vocab = vocab if with_vocab else None
        synchronize(target.device)
        t0 = time.perf_counter()
        out = drafter.draft(hidden[:, context:], anchor, len(ids), drafter.block_size, dcache, target.embed_table,
                            head, keep=keep)
        synchronize(target.device)
        dcache.crop(context)
        return time.perf_counter() - t0, out.tolist()

    print(f"# draft vocabulary: {len(vocab)} of {target.vocab_rows} ids; block {drafter.block_size}; "
          f"{runtime.device} {runtime.dtype}, {torch.get_num_threads()} threads, {runtime.forward}")
    print("| drafts kept | full vocabulary (ms) | draft vocabulary (ms) | ratio | same drafts |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for keep in args.keep:
        for _ in range(3):
            one(keep, True), one(keep, False)
        full, sub, same = [], [], 0
        for _ in range(args.repeats):  # alternated, so drift hits both alike
            t_sub, d_sub = one(keep, True)
            t_full, d_full = one(keep, False)
            sub.append(t_sub)
            full.append(t_full)
            same += d_sub == d_full
        f, s = statistics.median(full), statistics.median(sub)
        print(f"| {keep} | {1e3 * f:.2f} | {1e3 * s:.2f} | {s / f:.2f} | {same}/{args.repeats} |")
    drafter.draft_vocab = vocab


if __name__ == "__main__":
    main()
