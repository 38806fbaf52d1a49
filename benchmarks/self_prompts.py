"""Which temperature and top-p `train --prompts self:N` samples with: the prompts each setting writes, measured.

For each setting the target samples the same candidate indices from its user-turn header
(train/prompts/self_written.py) into a fresh folder; the table gives the share kept and why the others were
not, the kept prompts' category mix, length, distinct bigrams, distinct openings, near-duplicates, the
target's own mean negative log-likelihood of them (untempered: lower reads more like what the model considers
a normal request) and the sampling speed.

    .venv/bin/python benchmarks/self_prompts.py --candidates 256 --settings 1.0/1.0 1.0/0.95 0.8/0.95

With --compare N it instead samples `self:N` at the chosen settings and tabulates it beside the built-in sets
(mix:N, wide:N) and bench's prompts: the table docs/training.md gives.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_formats import cpu_line  # noqa: E402 - the same CPU line as the other CPU benchmarks


@torch.inference_mode()
def mean_nll(target, header: list[int], tokenizer, prompts: list[str]) -> float:
    """The target's mean per-token negative log-likelihood of each prompt after the header, averaged."""
    total = 0.0
    for p in prompts:
        ids = header + tokenizer.encode(p, add_special_tokens=False)
        logits = target.model(torch.tensor([ids])).logits[0, len(header) - 1 : -1].float()
        total += torch.nn.functional.cross_entropy(logits, torch.tensor(ids[len(header):])).item()
    return total / max(len(prompts), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--candidates", type=int, default=256)
    parser.add_argument("--settings", nargs="+", default=["1.0/1.0", "1.0/0.95", "0.8/0.95", "1.2/0.95"],
                        help="TEMPERATURE/TOP_P pairs")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--compare", type=int, default=None, metavar="N",
                        help="tabulate self:N (the chosen settings) beside mix:N, wide:N and bench's prompts")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from dflash_cli.engine.generate import default_stop_ids
    from dflash_cli.engine.load import load_target
    from dflash_cli.models.smollm2 import ensure_smollm2
    from dflash_cli.train.prompts import self_written as sp
    from dflash_cli.train.prompts.quality import category, prompt_stats, rejection

    folder = ensure_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    target = load_target(folder, device=torch.device("cpu"), dtype=torch.float32)
    stops = default_stop_ids(target, tokenizer)
    turn = sp.user_turn(tokenizer, stops)
    print(f"CPU: {cpu_line()}")
    if args.compare:
        compare(target, tokenizer, stops, args.compare)
        return
    print(f"SmolLM2-135M-Instruct (fp32), {args.candidates} candidates per setting, "
          f"{torch.get_num_threads()} threads\n")
    print("| temperature | top-p | kept | unfinished | other rejects | near-dup | math/code/chat/other % | "
          "words p10/med/p90 | distinct-2 | distinct openings | NLL | tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for setting in args.settings:
        temperature, top_p = (float(x) for x in setting.split("/"))
        settings = sp.SelfPromptSettings(seed=0, temperature=temperature, top_p=top_p,
                                         **({"max_tokens": args.max_tokens} if args.max_tokens else {}))
        with tempfile.TemporaryDirectory() as tmp:
            started, tokens = time.perf_counter(), 0
            store = sp.CandidateStore(Path(tmp), {"bench": setting})
            for i, ids, ended in sp.write_candidates(target, turn, range(args.candidates), settings):
                store.add(i, sp.candidate(tokenizer, turn, ids, ended))
                tokens += len(ids)
            seconds = time.perf_counter() - started
            chosen = sp.select(store.candidates, args.candidates)
        stats = prompt_stats(chosen.prompts, dict(chosen.rejected))
        unfinished = chosen.rejected.get("unfinished", 0)
        others = sum(chosen.rejected.values()) - unfinished - chosen.rejected.get("duplicate", 0)
        cats = "/".join(f"{100 * stats.categories[c]:.0f}" for c in ("math", "code", "chat", "other"))
        nll = mean_nll(target, turn.header, tokenizer, chosen.prompts)
        assert all(rejection(p, True) is None and category(p) for p in chosen.prompts)
        print(f"| {temperature:g} | {top_p:g} | {len(chosen.prompts)}/{args.candidates} | {unfinished} | {others} | "
              f"{chosen.rejected.get('duplicate', 0)} | {cats} | {stats.words_p10:.0f}/{stats.words_median:.0f}/"
              f"{stats.words_p90:.0f} | {stats.distinct_2:.3f} | {stats.first_words:.2f} | {nll:.2f} | "
              f"{tokens / seconds:.0f} |", flush=True)


def compare(target, tokenizer, stops: list[int], n: int) -> None:
    from dflash_cli.prompts.reader import BUILTIN_SETS, load_prompt_set
    from dflash_cli.train.prompts import self_written as sp
    from dflash_cli.train.prompts.mix import mix_prompts
    from dflash_cli.train.prompts.quality import prompt_stats
    from dflash_cli.train.prompts.wide import wide_prompts_with_categories

    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        own = sp.sample_self_prompts(target, tokenizer, n, Path(tmp), sp.SelfPromptSettings(), stop_ids=stops)
        seconds = time.perf_counter() - started
    tried = n + sum(own.stats.rejected.values())
    print(f"self:{n}: T={sp.TEMPERATURE}, top-p {sp.TOP_P}, {tried} samples in {seconds / 60:.1f} min "
          f"(rejected: {own.stats.rejected})\n")
    bench = [p.prompt for name in BUILTIN_SETS for p in load_prompt_set(name)]
    sets = {f"self:{n}": own.prompts, f"mix:{n}": mix_prompts(n),
            f"wide:{n}": [p for _, p in wide_prompts_with_categories(n)], f"bench ({len(bench)})": bench}
    print("| set | math/code/chat/other % | words p10/med/p90 | distinct-1 | distinct-2 | distinct openings | "
          "near-duplicates |")
    print("|---|---|---|---|---|---|---|")
    for name, prompts in sets.items():
        stats = prompt_stats(prompts)
        cats = "/".join(f"{100 * stats.categories[c]:.0f}" for c in ("math", "code", "chat", "other"))
        print(f"| {name} | {cats} | {stats.words_p10:.0f}/{stats.words_median:.0f}/{stats.words_p90:.0f} | "
              f"{stats.distinct_1:.3f} | {stats.distinct_2:.3f} | {stats.first_words:.2f} | "
              f"{100 * stats.near_duplicates:.1f}% |", flush=True)


if __name__ == "__main__":
    main()
