"""The static type of a transformers module read by the attribute names of its architecture."""

from __future__ import annotations

from typing import Any

# A transformers module (causal LM, decoder layer, attention, Gated DeltaNet) read by the attribute names its
# architecture gives it: typed Any, since nn.Module's __getattr__ types each such attribute as Tensor | Module.
HFModule = Any
