"""The config file: values become defaults, env vars and flags win, a broken file is named and left alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import save_target, save_tiny_tokenizer, target_config

from dflash_cli import settings as S


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = save_target(tmp_path_factory.mktemp("cfg") / "t", target_config("llama"), seed=1, scale=3.0)
    save_tiny_tokenizer(folder)
    return folder


def run_cli(args, env_extra, tmp_path):
    import os

    env = dict(os.environ, DFLASH_CONFIG=str(tmp_path / "config.toml"), **env_extra)
    return subprocess.run([sys.executable, "-m", "dflash_cli", *args], capture_output=True, text=True, env=env,
                          stdin=subprocess.DEVNULL, timeout=120)


def test_values_pairs_and_precedence(target, tmp_path):
    (tmp_path / "config.toml").write_text(
        f'model = "{target}"\nmax_tokens = 5\ndtype = "float32"\n\n[pairs.mine]\ntarget = "me/t"\n')
    config = S.load_config(tmp_path / "config.toml")
    assert config.values["max_tokens"] == 5 and config.pairs["mine"]["target"] == "me/t"

    def tokens(args, env):
        result = run_cli(["generate", "--json", *args, "hi"], env, tmp_path)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)["generated_tokens"]

    assert tokens([], {}) == 5  # from the file
    assert tokens([], {"DFLASH_MAX_TOKENS": "6"}) == 6  # the environment beats the file
    assert tokens(["-n", "7"], {"DFLASH_MAX_TOKENS": "6"}) == 7  # a flag beats both


def test_help_shows_config_defaults_and_variables(tmp_path):
    (tmp_path / "config.toml").write_text("temperature = 0.7\n")
    result = run_cli(["generate", "--help"], {}, tmp_path)
    assert result.returncode == 0
    assert "DFLASH_TEMPERATURE" in result.stdout and "default: 0.7" in result.stdout


def test_broken_config_is_named_with_its_line_and_never_rewritten(tmp_path):
    broken = 'model = "x"\nmax_tokens = = 3\n'
    (tmp_path / "config.toml").write_text(broken)
    result = run_cli(["generate", "hi"], {}, tmp_path)
    assert result.returncode == 2  # a usage error, as the same mistake in a flag or DFLASH_* is
    assert str(tmp_path / "config.toml") in result.stderr and "line 2" in result.stderr
    assert "Traceback" not in result.stderr
    assert (tmp_path / "config.toml").read_text() == broken
    still_helps = run_cli(["--help"], {}, tmp_path)
    assert still_helps.returncode == 0 and "Usage" in still_helps.stdout


@pytest.mark.parametrize("text, message", [("colour = 'always'\n", "unknown key 'colour'"),
                                           ("max_tokens = 'many'\n", "wrong type"),
                                           ("pairs = 3\n", "[pairs] must be a table")])
def test_bad_keys_and_types(tmp_path, text, message):
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(S.ConfigError, match=message.replace("[", r"\[")) as err:
        S.load_config(path)
    assert err.value.exit_code == 2


def test_a_bad_value_exits_2_from_the_file_as_from_the_environment(tmp_path):
    (tmp_path / "config.toml").write_text("temperature = -3\n")
    from_file = run_cli(["generate", "hi"], {}, tmp_path)
    assert from_file.returncode == 2 and "line 1" in from_file.stderr and "temperature" in from_file.stderr
    (tmp_path / "config.toml").write_text("")
    from_env = run_cli(["generate", "hi"], {"DFLASH_TEMPERATURE": "-3"}, tmp_path)
    assert from_env.returncode == 2 and "DFLASH_TEMPERATURE" in from_env.stderr
