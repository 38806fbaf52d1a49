"""The dflash-cli command group. Subcommands import the engine lazily: --help and --version stay fast."""

from __future__ import annotations

import click

from dflash_cli import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name="dflash-cli")
def cli() -> None:
    """Lossless block-diffusion speculative decoding (DFlash) on your own machine."""


def main() -> None:
    cli()
