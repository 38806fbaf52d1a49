"""The console script's cheapest paths: --version and --help must not import torch or transformers."""

from __future__ import annotations

import subprocess
import sys

from click.testing import CliRunner

from dflash_cli import __version__
from dflash_cli.ui.cli import cli


def test_version_and_help():
    runner = CliRunner()
    assert runner.invoke(cli, ["--version"]).output.strip() == f"dflash-cli, version {__version__}"
    result = runner.invoke(cli, ["--help"])
    assert result.exit_code == 0 and "speculative decoding" in result.output


def test_help_does_not_import_heavy_modules():
    code = ("import sys; from dflash_cli.ui.cli import cli\n"
            "try:\n    cli(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out
