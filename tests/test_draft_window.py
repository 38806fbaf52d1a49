"""--draft-window: the drafter attends to the last N context positions only; the target's output is unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import drafter_config, save_random_drafter, target_config
from support.speculation import oracle_for, tiny_pair

import dflash_cli
from dflash_cli import settings as S
from dflash_cli.engine.generate import generate
from dflash_cli.ui.cli import cli


@pytest.fixture(scope="module", params=["qwen3", "qwen3-fast", "llama-fast"])
def pair(request, tiny_models):
    return tiny_pair(tiny_models, request.param)


@pytest.mark.parametrize("window", [1, 4, 64])
def test_a_window_changes_the_drafts_only(pair, window):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
    plain = generate(pair.target, None, prompt, max_new_tokens=40, stop_ids=[])
    pair.drafter.context_window = window
    try:
        windowed = generate(pair.target, pair.drafter, prompt, max_new_tokens=40, stop_ids=[], block_size=4)
        # a drafter right half the time: rejected drafts roll the windowed context back as well
        oracle = oracle_for(pair, prompt, 40, acceptance=0.5, seed=1)
        with_oracle = generate(pair.target, oracle, prompt, max_new_tokens=40, stop_ids=[], block_size=8)
    finally:
        pair.drafter.context_window = None
    assert windowed.tokens == plain.tokens and with_oracle.tokens == plain.tokens
    assert windowed.stats.draft_window == window


def test_the_option_reaches_the_drafter_and_the_statistics(tiny_target_dir, tmp_path):
    target = str(tiny_target_dir)
    drafter = str(save_random_drafter(tmp_path / "drafter", drafter_config(target_config("qwen3")), seed=2))
    runtime = dflash_cli.load(target, draft=drafter, draft_window=6)
    assert runtime.drafter is not None and getattr(runtime.drafter, "context_window") == 6
    args = ["generate", "-m", target, "--draft", drafter, "-n", "12", "--no-chat-template", "--json", "hello"]
    windowed = CliRunner().invoke(cli, [*args, "--draft-window", "6"])
    plain = CliRunner().invoke(cli, [*args, "--no-draft"])
    assert windowed.exit_code == 0 and plain.exit_code == 0, windowed.stderr + plain.stderr
    assert json.loads(windowed.stdout)["draft_window"] == 6
    assert json.loads(windowed.stdout)["text"] == json.loads(plain.stdout)["text"]
    verbose = CliRunner().invoke(cli, args[:-2] + ["-v", "hello"], env={"DFLASH_DRAFT_WINDOW": "5"})
    assert verbose.exit_code == 0 and "draft window" in verbose.stderr and "last 5 tokens" in verbose.stderr
    bad = CliRunner().invoke(cli, [*args, "--draft-window", "-1"])
    assert bad.exit_code == 2 and "--draft-window" in bad.stderr


def test_the_drafters_config_names_its_window_and_the_option_overrides_it(tiny_target_dir, tmp_path):
    target = str(tiny_target_dir)
    config = drafter_config(target_config("qwen3"))
    config["dflash_config"]["draft_window"] = 5
    drafter = str(save_random_drafter(tmp_path / "drafter", config, seed=2))
    for asked, used in ((None, 5), (7, 7), (0, None)):
        runtime = dflash_cli.load(target, draft=drafter, draft_window=asked)
        assert getattr(runtime.drafter, "context_window") == used, asked
    args = ["generate", "-m", target, "--draft", drafter, "-n", "12", "--no-chat-template", "--json", "hello"]
    runs = {name: CliRunner().invoke(cli, [*args, *extra]) for name, extra in
            (("config", []), ("whole", ["--draft-window", "0"]), ("plain", ["--no-draft"]))}
    assert all(r.exit_code == 0 for r in runs.values()), [r.stderr for r in runs.values()]
    out = {name: json.loads(r.stdout) for name, r in runs.items()}
    assert out["config"]["draft_window"] == 5 and out["whole"]["draft_window"] is None
    assert out["config"]["text"] == out["whole"]["text"] == out["plain"]["text"]
    # the round costs are kept under the window drafted with: a whole context's do not hold for a window
    kept = [json.loads(f.read_text())["key"] for f in (S.cache_dir() / "round-costs").glob("*.json")]
    assert sorted(str(k["draft_window"]) for k in kept if k["drafter"] == str(Path(drafter).resolve())) == [
        "5", "None"]


@pytest.mark.parametrize("value", [0, -3, "128", True, 1.5])
def test_a_bad_window_in_the_config_is_one_line_naming_it(tiny_target_dir, tmp_path, value):
    config = drafter_config(target_config("qwen3"))
    drafter = save_random_drafter(tmp_path / "drafter", config, seed=2)
    raw = json.loads((drafter / "config.json").read_text())
    raw["dflash_config"]["draft_window"] = value
    (drafter / "config.json").write_text(json.dumps(raw))
    got = CliRunner().invoke(cli, ["generate", "-m", str(tiny_target_dir), "--draft", str(drafter), "-n", "4",
                                   "--no-chat-template", "hello"])
    assert got.exit_code != 0 and "dflash_config.draft_window" in got.stderr and "Traceback" not in got.stderr
