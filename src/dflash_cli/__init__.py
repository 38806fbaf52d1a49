"""dflash-cli: lossless block-diffusion speculative decoding (DFlash) from the terminal.

Importing this package is cheap: torch and transformers load only when the engine is used.
"""

__version__ = "0.1.0.dev0"
