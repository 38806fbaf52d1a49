"""pull, list/ls, show and rm through the CLI, against the loopback FakeHub with the real huggingface_hub client."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from support.hf_configs import DATA
from support.hub_fixtures import DRAFTER, TARGET, fake, online, server  # noqa: F401 (shared fixtures)
from support.models_cli import OTHER_D, OTHER_T, env, invoke, repo_files  # noqa: F401 (shared fixtures)


def _snapshot_files(cache: Path, repo_id: str) -> set[str]:
    snaps = cache / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    return {p.relative_to(next(snaps.iterdir())).as_posix() for p in snaps.rglob("*") if p.is_file()}


def test_pull_pair(fake, online, env, repo_files):
    result = invoke("pull", "tiny", endpoint=fake.endpoint)
    assert result.exit_code == 0, result.output
    for repo in (TARGET, DRAFTER):
        names = _snapshot_files(env, repo)
        assert "config.json" in names and "model.safetensors" in names
        assert not [n for n in names if n.endswith((".py", ".bin"))], names
        assert f"{repo} -> {env}" in result.stderr
    assert "tokenizer.json" in _snapshot_files(env, TARGET)
    assert not fake.gets("/model.py") and not fake.gets("/pytorch_model.bin")
    assert result.stdout == ""  # everything but tables goes to stderr
    assert "\x1b[" not in result.stderr  # no bars without a terminal


def test_pull_repo_id_finds_drafter_and_no_draft(fake, online, env):
    result = invoke("pull", TARGET, "--no-draft", endpoint=fake.endpoint)
    assert result.exit_code == 0, result.output
    assert (env / f"models--{TARGET.replace('/', '--')}").is_dir()
    assert not (env / f"models--{DRAFTER.replace('/', '--')}").exists()
    result = invoke("pull", TARGET, endpoint=fake.endpoint)  # the registry names the drafter
    assert result.exit_code == 0, result.output
    assert (env / f"models--{DRAFTER.replace('/', '--')}").is_dir()


def test_pull_dry_run_sizes_and_nothing_downloaded(fake, online, env, repo_files):
    result = invoke("pull", "tiny", "--dry-run", endpoint=fake.endpoint)
    assert result.exit_code == 0, result.output
    from dflash_cli.models.hub import wanted
    from dflash_cli.units import fmt_bytes

    lines = result.stdout.splitlines()
    for repo in (TARGET, DRAFTER):
        files = {p: d for p, d in repo_files[repo].items() if wanted(p)}
        for path, data in files.items():
            assert any(line.split()[:3] == [path, *fmt_bytes(len(data)).split()] for line in lines), (path, lines)
        total = sum(len(d) for d in files.values())
        assert f"{repo} (revision main" in result.stdout and f"{fmt_bytes(total)} to download" in result.stdout
    assert "model.py" not in [line.split()[0] for line in lines if line.strip()]
    assert not fake.gets("/model.safetensors") and not fake.gets("/config.json")
    assert not any(env.rglob("*.safetensors"))
    assert "nothing downloaded" in result.stderr

    assert invoke("pull", "tiny", endpoint=fake.endpoint).exit_code == 0  # then: everything is cached
    again = invoke("pull", "tiny", "--dry-run", endpoint=fake.endpoint)
    assert "0 B to download" in again.stdout and "cached" in again.stdout


def test_list_shows_both_repos(fake, online, env):
    assert invoke("pull", "tiny", endpoint=fake.endpoint).exit_code == 0
    result = invoke("list")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split()[:4] == ["REPO", "PAIR", "ROLE", "SIZE"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert set(rows) == {TARGET, DRAFTER}
    assert rows[TARGET][1:3] == ["tiny", "target"] and rows[DRAFTER][1:3] == ["tiny", "drafter"]
    assert rows[TARGET][4] in ("KiB", "MiB") and "main" in rows[TARGET]
    assert [line.index("ROLE") for line in lines[:1]] == [lines[1].index("target")]  # aligned

    quiet = invoke("ls", "-q")
    assert quiet.exit_code == 0 and quiet.stdout.split() == [TARGET, DRAFTER]

    data = json.loads(invoke("list", "--json").stdout)
    by_id = {d["repo_id"]: d for d in data}
    assert set(by_id) == {TARGET, DRAFTER}
    assert by_id[DRAFTER]["role"] == "drafter" and by_id[DRAFTER]["pair"] == "tiny"
    assert by_id[TARGET]["size_bytes"] > 0 and by_id[TARGET]["refs"] == ["main"]
    assert len(by_id[TARGET]["revisions"][0]) == 40


def test_list_empty_and_known(env):
    result = invoke("list")
    assert result.exit_code == 0 and result.stdout == "" and "no models" in result.stderr
    known = invoke("list", "--known")
    assert known.exit_code == 0
    rows = {line.split()[0]: line for line in known.stdout.splitlines()[1:]}
    assert "qwen3-8b" in rows and "Qwen/Qwen3-8B" in rows["qwen3-8b"]
    assert "z-lab/Qwen3-8B-DFlash-b16" in rows["qwen3-8b"]
    assert "tiny" in rows and "z-lab/Qwen3.5-4B-DFlash" in rows["qwen3.5-4b"]
    data = json.loads(invoke("list", "--known", "--json").stdout)
    assert {"alias": "qwen3-8b", "target": "Qwen/Qwen3-8B"}.items() <= next(
        d for d in data if d["alias"] == "qwen3-8b").items()


def test_show_pair_and_memory_plan(fake, online, env):
    result = invoke("show", "tiny", endpoint=fake.endpoint)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert TARGET in out and DRAFTER in out and "a tiny test pair" in out
    assert "hidden 64, 6 layers, vocab 160" in out
    assert "block size 8, taps [1, 3, 4], mask id 150" in out
    assert "memory plan" in out and "target weights (bf16)" in out and "total" in out
    assert "8,192 tokens" in out and "(default)" in out

    data = json.loads(invoke("show", "tiny", "--json", "--quant", "nf4", "--context", "1024",
                             endpoint=fake.endpoint).stdout)
    assert data["target"] == TARGET and data["drafter"] == DRAFTER
    assert data["summary"]["drafter"]["block_size"] == 8
    assert data["memory"]["quant"] == "nf4" and data["memory"]["context_tokens"] == 1024
    assert data["settings"]["quant"] == {"value": "nf4", "from": "flag"}
    assert data["memory"]["total_bytes"] > 0 and data["memory"]["available_bytes"] > 0
    plans = {q: json.loads(invoke("show", "tiny", "--json", "--quant", q, endpoint=fake.endpoint).stdout)["memory"]
             for q in ("bf16", "q4", "q4a8")}  # the CPU's formats plan too
    # a dense target loads layer by layer under q4 (engine/layerwise.py): its codes and one 16-bit layer
    weights = {q: plans[q]["components"]["target weights"] for q in plans}
    assert plans["q4"]["quant"] == "q4" and weights["bf16"] / 2 < weights["q4"] < weights["bf16"]
    # q4a8 runs fp32 activations: its caches hold 4 bytes a value, q4's (bf16 activations) 2
    caches = {q: plans[q]["components"]["target KV cache"] for q in plans}
    assert caches["q4a8"] == 2 * caches["q4"] == 2 * caches["bf16"] > 0


def test_show_offline_not_cached_says_so(env):
    result = invoke("show", "tiny")
    assert result.exit_code == 0, result.output
    assert "HF_HUB_OFFLINE" in result.stdout and "unavailable" in result.stdout


def test_rm_removes_exactly_one_pair(fake, online, env):
    assert invoke("pull", "tiny", endpoint=fake.endpoint).exit_code == 0
    assert invoke("pull", "other", endpoint=fake.endpoint).exit_code == 0
    assert set(invoke("ls", "-q").stdout.split()) == {TARGET, DRAFTER, OTHER_T, OTHER_D}

    refused = invoke("rm", "tiny")  # CliRunner's stdin is not a terminal
    assert refused.exit_code == 2
    assert "-y" in refused.stderr and TARGET in refused.stderr
    assert len(invoke("ls", "-q").stdout.split()) == 4

    result = invoke("rm", "tiny", "-y")
    assert result.exit_code == 0, result.output
    assert "freed" in result.stderr
    assert set(invoke("ls", "-q").stdout.split()) == {OTHER_T, OTHER_D}

    one = invoke("rm", OTHER_D, "-y")  # a repo id removes that repo only
    assert one.exit_code == 0, one.output
    assert invoke("ls", "-q").stdout.split() == [OTHER_T]

    gone = invoke("rm", "tiny", "-y")
    assert gone.exit_code == 1 and "not in the local cache" in gone.stderr


def test_rm_confirmation_on_a_terminal(fake, online, env, monkeypatch):
    assert invoke("pull", "tiny", endpoint=fake.endpoint).exit_code == 0
    monkeypatch.setattr("dflash_cli.ui.render.isatty", lambda stream: True)
    no = invoke("rm", "tiny", input="n\n")
    assert no.exit_code == 0 and "nothing removed" in no.stderr
    assert len(invoke("ls", "-q").stdout.split()) == 2
    yes = invoke("rm", "tiny", input="y\n")
    assert yes.exit_code == 0 and "Remove 2 repos" in yes.stderr
    assert invoke("ls", "-q").stdout == ""


@pytest.mark.parametrize("command", ["pull", "show", "rm"])
def test_unknown_model_one_line_error(env, command):
    result = invoke(command, "no-such-model")
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert lines[0] == "Error: model 'no-such-model' is not a known name or a Hub repo id (org/name)"
    assert lines[1].startswith("Hint: known names:") and "qwen3-8b" in lines[1] and "tiny" in lines[1]
    assert len(lines) == 2


def test_pull_offline_not_downloaded(env):
    result = invoke("pull", "tiny")
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: {TARGET} is not downloaded")


def test_unknown_repo_on_hub(fake, online, env):
    result = invoke("pull", "nobody/nothing", endpoint=fake.endpoint)
    assert result.exit_code == 1
    assert "was not found on the Hub" in result.stderr and len(result.stderr.splitlines()) == 2


def test_rich_tqdm_forwards_to_progress():
    from rich.console import Console
    from rich.progress import Progress

    from dflash_cli.ui.download_progress import make_tqdm_class

    progress = Progress(console=Console(file=io.StringIO()))
    cls = make_tqdm_class(progress, "org/repo")
    transfer = cls(desc="Downloading bytes", total=0, unit="B")
    written = cls(desc="Reconstructing (incomplete total...)", total=0, unit="B")
    files = cls(desc="Fetching 3 files", total=3)
    written.total = 100
    written.refresh()
    written.update(40)
    files.update(1)
    transfer.update(10)
    tasks = {t.description: t for t in progress.tasks}
    assert set(tasks) == {"org/repo", "org/repo files"}
    assert (tasks["org/repo"].completed, tasks["org/repo"].total) == (40, 100)
    assert (tasks["org/repo files"].completed, tasks["org/repo files"].total) == (1, 3)
    for bar in (transfer, written, files):
        bar.close()


def test_progress_disabled_by_env(monkeypatch):
    from dflash_cli.ui.download_progress import progress_enabled

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    assert progress_enabled(Tty()) and not progress_enabled(io.StringIO())
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    assert not progress_enabled(Tty())


# -- one resolver: every command reads a -m value the same way (models/resolve.py) ----------------------

def test_a_folder_without_config_json_does_not_shadow_a_name_in_any_command(fake, online, env, tmp_path,
                                                                            monkeypatch):
    from dflash_cli.models.resolve import resolve_spec

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()  # an empty folder named like the pair: the name wins everywhere
    removed = invoke("rm", "tiny", "-y")
    assert removed.exit_code == 1 and f"({TARGET}, {DRAFTER})" in removed.stderr
    shown = json.loads(invoke("show", "tiny", "--json", endpoint=fake.endpoint).stdout)
    assert shown["target"] == TARGET and shown["drafter"] == DRAFTER
    planned = invoke("pull", "tiny", "--dry-run", endpoint=fake.endpoint)
    assert planned.exit_code == 0 and f"target {TARGET}" in planned.stdout
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    generated = invoke("generate", "-m", "tiny", "hi")
    assert generated.exit_code == 1 and f"Error: {TARGET} is only partly downloaded" in generated.stderr
    assert resolve_spec("tiny").target == TARGET


def test_a_model_folder_named_like_a_pair_is_that_folder_in_every_command(env, tmp_path, monkeypatch, repo_files):
    from dflash_cli.models.resolve import resolve_spec

    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_bytes(repo_files[TARGET]["config.json"])
    assert resolve_spec("tiny").kind == "folder"
    shown = json.loads(invoke("show", "tiny", "--json").stdout)
    assert shown["target"] == "tiny" and shown["configs"]["target"] == str(Path("tiny") / "config.json")
    pulled = invoke("pull", "tiny")
    assert pulled.exit_code == 1 and "tiny is a local folder: there is nothing to pull" in pulled.stderr
    removed = invoke("rm", "tiny", "-y")  # not the cached pair of the same name
    assert removed.exit_code == 1 and "tiny is a local folder" in removed.stderr


def test_unsupported_pairs_are_shown_and_removable_but_not_run_or_pulled(env, tmp_path, monkeypatch):
    config = tmp_path / "later.toml"
    config.write_text('[pairs.later]\ntarget = "a/b"\nunsupported = "mamba layers cannot roll back yet"\n')
    monkeypatch.setenv("DFLASH_CONFIG", str(config))
    assert json.loads(invoke("show", "later", "--json").stdout)["unsupported"] == "mamba layers cannot roll back yet"
    assert "later is not in the local cache (a/b)" in invoke("rm", "later", "-y").stderr
    for args in (["pull", "later"], ["generate", "-m", "later", "hi"]):
        result = invoke(*args)
        assert result.exit_code == 1 and "is not supported: mamba layers" in result.stderr, args


def test_show_plans_with_the_configured_max_context(env, monkeypatch, repo_files, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_bytes(repo_files[TARGET]["config.json"])
    config = Path(monkeypatch_config := str(tmp_path / "config.toml"))
    config.write_text(config.read_text().replace("[pairs.tiny]", "max_context = 2048\n\n[pairs.tiny]"))
    data = json.loads(invoke("show", str(folder), "--json").stdout)
    assert data["memory"]["context_tokens"] == 2048
    assert data["settings"]["context"] == {"value": 2048, "from": f"config file {monkeypatch_config}"}
    monkeypatch.setenv("DFLASH_MAX_CONTEXT", "4096")
    data = json.loads(invoke("show", str(folder), "--json").stdout)
    assert data["settings"]["context"] == {"value": 4096, "from": "env DFLASH_MAX_CONTEXT"}
    data = json.loads(invoke("show", str(folder), "--json", "--max-context", "512").stdout)
    assert data["memory"]["context_tokens"] == 512 and data["settings"]["context"]["from"] == "flag"


def test_show_plans_against_the_device_generate_would_use(env, monkeypatch, repo_files, tmp_path):
    from dflash_cli.engine import device as device_mod

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_bytes(repo_files[TARGET]["config.json"])
    asked = []
    monkeypatch.setattr(device_mod, "free_memory", lambda d: asked.append(str(d)) or 3 << 30)
    data = json.loads(invoke("show", str(folder), "--json", "--device", "cpu").stdout)
    assert asked == ["cpu"] and data["memory"]["available_bytes"] == 3 << 30
    assert data["memory"]["available"] == "free system memory on cpu"
    assert data["settings"]["device"] == {"value": "cpu", "from": "flag"}
    # a device this machine lacks: show refuses it with generate's own words (and exit code)
    shown = invoke("show", str(folder), "--device", "cuda:7")
    generated = invoke("generate", "-m", str(folder), "--device", "cuda:7", "hi")
    assert shown.exit_code == generated.exit_code == 2
    assert shown.stderr.splitlines()[0] == generated.stderr.splitlines()[0]
    assert "cuda:7" in shown.stderr


def test_show_and_list_the_built_in_model_before_and_after_its_first_run(env, tmp_path):
    from dflash_cli.models.smollm2 import smollm2_dir

    before = json.loads(invoke("show", "demo", "--json").stdout)
    assert before["builtin"] and before["name"] == "demo" and before["memory"] is None
    assert "not converted yet" in before["configs"]["target"]
    assert before["summary"]["drafter"]["block_size"] == 8  # the shipped drafter's config is read
    assert invoke("list", "-q").stdout == ""
    # what the first run leaves behind: a converted checkpoint folder in dflash-cli's cache
    folder = smollm2_dir()
    folder.mkdir(parents=True)
    (folder / "config.json").write_text((Path(__file__).parent / "data" / "hf-configs" /
                                         "HuggingFaceTB__SmolLM2-135M-Instruct" / "config.json").read_text())
    after = invoke("show", "demo")
    assert after.exit_code == 0
    assert "llama, hidden 576, 30 layers" in after.stdout and "memory plan (against" in after.stdout
    assert "built in" in after.stdout
    rows = invoke("list").stdout.splitlines()
    assert rows[0].split()[:3] == ["REPO", "PAIR", "ROLE"]
    assert rows[1].split()[:4] == ["smollm2-135m", "demo", "built", "in"]


# -- issue 27: the new pairs, offline (the loopback Hub serves the stored configs) ----------------------------



def _stored(name: str) -> bytes:
    return (DATA / name / "config.json").read_bytes()


def _gemma_31b() -> bytes:
    """The stand-in for google/gemma-4-31B-it: NVIDIA's NVFP4 re-release of it without its NVFP4 block
    (SOURCES.md: the google file is expected to be exactly that)."""
    config = json.loads(_stored("nvidia__Gemma-4-31B-IT-NVFP4"))
    config.pop("quantization_config")
    return json.dumps(config, indent=2).encode()


def _glm_fp8() -> bytes:
    """zai-org/GLM-5.1-FP8 (the drafter's target): the stored GLM-5.1 file, whose architecture it shares, with
    a block-wise fp8 quantization_config (the FP8 release's exact file was not found)."""
    config = json.loads(_stored("zai-org__GLM-5.1"))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    return json.dumps(config, indent=2).encode()


def _drafter(hidden: int, layers: int, inter: int, heads: int, kv: int, head_dim: int, vocab: int, block: int,
             mask: int, taps: list[int], target_layers: int, sliding: int = 0) -> bytes:
    """A drafter config.json from the fields SOURCES.md ("New pairs") gives: none of these files was found
    verbatim."""
    kinds = ["sliding_attention"] * sliding + ["full_attention"] * (layers - sliding)
    return json.dumps({"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": block,
                       "dflash_config": {"mask_token_id": mask, "target_layer_ids": taps},
                       "num_target_layers": target_layers, "num_hidden_layers": layers, "hidden_size": hidden,
                       "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
                       "head_dim": head_dim, "vocab_size": vocab, "layer_types": kinds,
                       "sliding_window": 2048 if sliding else None, "use_sliding_window": bool(sliding)}).encode()


def _qwen3_coder_next() -> bytes:
    from support.hf_configs import QWEN3_CODER_NEXT

    return json.dumps(QWEN3_CODER_NEXT).encode()


# name: (target repo, its config.json, drafter repo, its config.json or None: not on the (fake) Hub)
NEW = {
    "gpt-oss-120b": ("openai/gpt-oss-120b", lambda: _stored("openai__gpt-oss-120b"), "z-lab/gpt-oss-120b-DFlash",
                     lambda: _drafter(2880, 8, 7680, 64, 8, 64, 201088, 10, 200000, [1, 9, 17, 25, 33], 36)),
    "kimi-k2.5": ("moonshotai/Kimi-K2.5", lambda: _stored("moonshotai__Kimi-K2.5"), "z-lab/Kimi-K2.5-DFlash",
                  lambda: _drafter(7168, 6, 18432, 64, 8, 128, 163840, 8, 163838, [1, 12, 24, 35, 47, 58], 61)),
    "glm-5.1": ("zai-org/GLM-5.1-FP8", _glm_fp8, "z-lab/GLM-5.1-FP8-DFlash", None),  # nothing published
    "gemma-4-26b-a4b": ("google/gemma-4-26B-A4B-it", lambda: _stored("google__gemma-4-26B-A4B-it"),
                        "z-lab/gemma-4-26B-A4B-it-DFlash",
                        lambda: _drafter(2816, 5, 5632, 32, 8, 128, 262144, 16, 4, [1, 6, 11, 17, 22, 27], 30, 4)),
    "gemma-4-31b": ("google/gemma-4-31B-it", _gemma_31b, "z-lab/gemma-4-31B-it-DFlash",
                    lambda: _drafter(5376, 5, 10752, 64, 8, 128, 262144, 16, 4, [1, 12, 23, 35, 46, 57], 60, 4)),
    "qwen3-coder-next": ("Qwen/Qwen3-Coder-Next", _qwen3_coder_next, "z-lab/Qwen3-Coder-Next-DFlash",
                         lambda: _drafter(2048, 8, 6144, 32, 4, 64, 151936, 16, 151669, [3, 11, 23, 35, 43], 48)),
}
WEIGHTS = {"model-00001-of-00002.safetensors": b"\0" * 64, "model-00002-of-00002.safetensors": b"\0" * 32,
           "tokenizer.json": b"{}"}


@pytest.fixture
def new_pairs(fake):
    for target, target_cfg, drafter, drafter_cfg in NEW.values():
        fake.add_revision(target, {"config.json": target_cfg(), **WEIGHTS})
        if drafter_cfg is not None:
            fake.add_revision(drafter, {"config.json": drafter_cfg(), "model.safetensors": b"\0" * 16})
    fake.reset_requests()
    return fake


def _weights_asked(fake) -> list:
    return [r for r in fake.requests if ".safetensors" in r.path and "/resolve/" in r.path]


@pytest.mark.parametrize("name", list(NEW))
def test_show_every_new_pair_offline(new_pairs, online, env, name):
    target, _, drafter, drafter_cfg = NEW[name]
    result = invoke("show", name, "--device", "cpu", endpoint=new_pairs.endpoint)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert f"target      {target}" in out and f"drafter     {drafter}" in out
    assert "memory plan (against free system memory on cpu)" in out and "target weights (bf16)" in out
    engine = name in ("kimi-k2.5", "glm-5.1")
    assert ("runs        on a multi-GPU server (serve-cmd, tp 8)" in out) == engine
    assert ("needs a multi-GPU server: weights" in out) == engine
    if engine:  # where it runs instead of knobs that would not make it fit here
        assert f"serve it there: dflash-cli serve-cmd {name} --engine vllm --tp 8 (or --engine sglang)" in out
        assert f"--engine http://SERVER:8000 -m {name}" in out and "alternatives:" not in out
    if drafter_cfg is None:  # GLM-5.1's drafter config is not published: the plan goes on without it
        assert "drafter weights (none)" in out
    else:
        assert f"block size {load_block(drafter_cfg())}" in out
    if name == "gpt-oss-120b":
        assert "MXFP4 experts dequantized to bf16 when loaded: transformers dequantizes them on cpu" in out
        assert "MXFP4 experts kept packed (a CUDA GPU" in out  # the alternative that fits a big GPU
    assert not _weights_asked(new_pairs)
    data = json.loads(invoke("show", name, "--json", endpoint=new_pairs.endpoint).stdout)
    assert data["runs"] == ("engine" if engine else "local") and ("server" in data) == engine
    if engine:
        assert {g["count"] for g in data["server"]["gpus"] if g["gpu_bytes"] == 80 << 30} == {8 if name == "kimi-k2.5"
                                                                                              else 10}


def load_block(drafter_cfg: bytes) -> int:
    return json.loads(drafter_cfg)["block_size"]


@pytest.mark.parametrize("name", list(NEW))
def test_pull_dry_run_every_new_pair_offline(new_pairs, online, env, name):
    target, _, drafter, drafter_cfg = NEW[name]
    args = ["pull", name, "--dry-run"] + ([] if drafter_cfg else ["--no-draft"])
    result = invoke(*args, endpoint=new_pairs.endpoint)
    assert result.exit_code == 0, result.output
    assert f"target {target} (revision main" in result.stdout
    assert (f"drafter {drafter} (revision main" in result.stdout) == bool(drafter_cfg)
    assert "model-00001-of-00002.safetensors" in result.stdout and "nothing downloaded" in result.stderr
    assert not _weights_asked(new_pairs) and not any(env.rglob("*.safetensors"))


@pytest.mark.parametrize("model", ["kimi-k2.5", "moonshotai/Kimi-K2.5", "glm-5.1"])
def test_running_a_giant_here_is_refused_before_any_request(new_pairs, online, env, model):
    result = invoke("generate", "-m", model, "hi")
    assert result.exit_code == 1, result.output  # an error, as a pair that does not fit (README: 1 error, 2 usage)
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and result.stdout == "", lines
    name, target = ("glm-5.1", "zai-org/GLM-5.1-FP8") if model == "glm-5.1" else ("kimi-k2.5", "moonshotai/Kimi-K2.5")
    assert lines[0] == (f"Error: {name} ({target}) is served by a multi-GPU server (vLLM or SGLang), not run here: "
                        "nothing was downloaded")
    assert lines[1].startswith(f"Hint: on the server: dflash-cli serve-cmd {name} --engine vllm --tp 8")
    assert f"--engine http://SERVER:8000 -m {name}" in lines[1]
    assert new_pairs.requests == []  # not even config.json
    assert not any(env.rglob("*"))


def test_a_giant_is_refused_the_same_way_offline(env):
    result = invoke("generate", "-m", "kimi-k2.5", "--device", "cpu", "hi")  # HF_HUB_OFFLINE is set (conftest)
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: kimi-k2.5 (moonshotai/Kimi-K2.5) is served by a multi-GPU server")


def test_bitsandbytes_on_an_mxfp4_target_is_refused_before_the_weights(new_pairs, online, env):
    from dflash_cli.engine.errors import InvalidSettingError
    from dflash_cli.models.resolve import resolve_pair
    from dflash_cli.ui.errors import EXIT_USAGE, describe

    # transformers would refuse it only after the download ("The model is quantized with Mxfp4Config but
    # you are passing a BitsAndBytesConfig")
    with pytest.raises(InvalidSettingError) as refused:
        resolve_pair("gpt-oss-120b", quant="nf4", endpoint=new_pairs.endpoint)
    message, hint, code = describe(refused.value)
    assert message == "--quant nf4: gpt-oss-120b is published quantized (mxfp4), and transformers does not " \
                      "quantize it again"
    assert hint == "leave --quant out (or --quant auto)" and code == EXIT_USAGE
    assert new_pairs.gets("/config.json") and not _weights_asked(new_pairs)


def test_list_known_says_which_pairs_run_here_and_which_through_an_engine(env):
    known = invoke("list", "--known")
    assert known.exit_code == 0
    lines = known.stdout.splitlines()
    header = lines[0].split()
    assert header == ["NAME", "TARGET", "DRAFTER", "BLOCK", "THINKING", "RUNS", "STATUS"]
    column = lines[0].index("RUNS")
    runs = {line.split()[0]: line[column:].split("   ")[0].strip() for line in lines[1:]}
    assert runs["kimi-k2.5"] == runs["glm-5.1"] == "engine (tp 8)"
    assert {runs[n] for n in runs if n not in ("kimi-k2.5", "glm-5.1")} == {"here"}
    assert "serve-cmd NAME --engine vllm|sglang" in known.stderr and "--engine URL" in known.stderr
    data = {d["alias"]: d for d in json.loads(invoke("list", "--known", "--json").stdout)}
    assert data["kimi-k2.5"]["runs"] == "engine" and data["kimi-k2.5"]["serve_tp"] == 8
    assert data["gpt-oss-120b"]["runs"] == "local" and data["gpt-oss-120b"]["block_size"] == 10
    assert data["gpt-oss-20b"]["block_size"] == 8 and data["demo"]["runs"] == "local"


def test_pulling_a_giant_is_refused_before_any_request(new_pairs, online, env):
    result = invoke("pull", "kimi-k2.5")
    assert result.exit_code == 1 and "nothing was downloaded" in result.stderr, result.output
    assert new_pairs.requests == [] and not any(env.rglob("*.safetensors"))
