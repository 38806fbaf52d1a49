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
                                           ("temperature = true\n", "wrong type"),  # a TOML boolean is no number
                                           ("max_tokens = true\n", "wrong type"),
                                           ("pairs = 3\n", "[pairs] must be a table")])
def test_bad_keys_and_types(tmp_path, text, message):
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(S.ConfigError, match=message.replace("[", r"\[")) as err:
        S.load_config(path)
    assert err.value.exit_code == 2


def test_an_integer_temperature_is_a_number(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("temperature = 1\ntop_p = 1\n")
    assert S.load_config(path).values == {"temperature": 1, "top_p": 1}


@pytest.mark.parametrize("how", ["folder", "binary", "dangling link"])
def test_a_config_path_that_is_no_toml_file_exits_2_wherever_it_is_named(tmp_path, how):
    """The default path (under XDG_CONFIG_HOME) and DFLASH_CONFIG follow one rule: the path, the cause, exit 2."""
    import os

    path = tmp_path / "dflash-cli" / "config.toml"
    path.parent.mkdir()
    if how == "folder":
        path.mkdir()
    elif how == "binary":
        path.write_bytes(bytes(range(256)))
    else:
        path.symlink_to(tmp_path / "nowhere.toml")
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_CONFIG"}
    for extra in ({"XDG_CONFIG_HOME": str(tmp_path)}, {"DFLASH_CONFIG": str(path)}):
        result = subprocess.run([sys.executable, "-m", "dflash_cli", "generate", "hi"], capture_output=True,
                                text=True, env={**env, **extra}, stdin=subprocess.DEVNULL, timeout=120)
        assert result.returncode == 2, (extra, result.stderr)
        assert str(path) in result.stderr and "Traceback" not in result.stderr
        assert len([line for line in result.stderr.splitlines() if line.startswith("Error:")]) == 1


def test_a_bad_value_exits_2_from_the_file_as_from_the_environment(tmp_path):
    (tmp_path / "config.toml").write_text("temperature = -3\n")
    from_file = run_cli(["generate", "hi"], {}, tmp_path)
    assert from_file.returncode == 2 and "line 1" in from_file.stderr and "temperature" in from_file.stderr
    (tmp_path / "config.toml").write_text("")
    from_env = run_cli(["generate", "hi"], {"DFLASH_TEMPERATURE": "-3"}, tmp_path)
    assert from_env.returncode == 2 and "DFLASH_TEMPERATURE" in from_env.stderr


# A bad --device, --device-map or --max-memory is only found after parsing (placement.py, device.py); it is still
# blamed on where it was set: the flag, the DFLASH_* variable, or the config file's path and line.
SETTINGS = {
    "max_memory, bad device": ({"max_memory": "x=", "device_map": "auto"}, "unknown device 'x'"),
    "max_memory, bad size": ({"max_memory": "cpu=14Gx", "device_map": "auto"}, "'14Gx' is not a size"),
    "max_memory without device_map": ({"max_memory": "cpu=1GiB"}, "applies to a split: it needs --device-map"),
    "device": ({"device": "tpu"}, "unknown device 'tpu'"),
}


def _set(where: str, values: dict[str, str], tmp_path):
    """(flags, environment) that set `values` from `where`; the config file is written for 'file'."""
    (tmp_path / "config.toml").write_text(
        "".join(f'{k} = "{v}"\n' for k, v in values.items()) if where == "file" else "")
    flags = [a for k, v in values.items() for a in (f"--{k.replace('_', '-')}", v)] if where == "flag" else []
    env = {S.ENV[k]: v for k, v in values.items()} if where == "env" else {}
    return flags, env


@pytest.mark.parametrize("where", ["flag", "env", "file"])
@pytest.mark.parametrize("case", SETTINGS)
def test_a_bad_setting_is_blamed_on_where_it_was_set(target, tmp_path, where, case):
    values, message = SETTINGS[case]
    flags, env = _set(where, values, tmp_path)
    result = run_cli(["generate", "-m", str(target), *flags, "hi"], env, tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    error, hint = result.stderr.strip().splitlines()
    assert error.startswith("Error: ") and message in error and hint.startswith("Hint: ")
    key = next(iter(values))  # the setting at fault
    flag, var, file = f"--{key.replace('_', '-')}", S.ENV[key], f"config file {tmp_path / 'config.toml'}"
    named = {"flag": flag in error, "env": var in error, "file": file in error}
    if key == "device":  # the flag's own error keeps the words it always had: "unknown device 'tpu'"
        named["flag"] = where == "flag"
    assert named == {w: w == where for w in named}, error
    if where == "file":
        assert f"{file}, line 1: {key} = {values[key]!r}" in error


def test_show_blames_a_bad_config_value_on_its_line(target, tmp_path):
    (tmp_path / "config.toml").write_text('quant = "none"\ndevice_map = "auto"\nmax_memory = "cpu=1GiB,x="\n')
    result = run_cli(["show", str(target)], {}, tmp_path)
    assert result.returncode == 2, result.stderr
    error = result.stderr.strip().splitlines()[0]
    assert error.startswith(f"Error: config file {tmp_path / 'config.toml'}, line 3: max_memory = 'cpu=1GiB,x='")
    assert "--max-memory" not in error and "unknown device 'x'" in error


@pytest.mark.parametrize("where, expected", [("file", "nf4"), ("env", "int8"), ("flag", "q8")])
def test_show_takes_quant_from_the_flag_then_the_environment_then_the_file(target, tmp_path, where, expected):
    (tmp_path / "config.toml").write_text('quant = "nf4"\n')
    env = {"DFLASH_QUANT": "int8"} if where in ("env", "flag") else {}
    flags = ["--quant", "q8"] if where == "flag" else []
    result = run_cli(["show", str(target), "--json", *flags], env, tmp_path)
    assert result.returncode == 0, result.stderr
    setting = json.loads(result.stdout)["settings"]["quant"]
    assert setting["value"] == expected and where in setting["from"], setting


def test_chat_reads_the_config_file_as_generate_does(tmp_path):
    (tmp_path / "config.toml").write_text('temperature = 0.7\nmax_tokens = 77\ntop_k = 9\n')
    result = run_cli(["chat", "--help"], {}, tmp_path)
    assert result.returncode == 0, result.stderr
    for shown in ("default: 0.7", "default: 77", "default: 9"):
        assert shown in result.stdout.replace("\n", " ").replace("  ", " "), shown
