"""Model management without torch: names and the registry, the Hugging Face Hub (hub.py online, cache.py the
local cache, folders.py where it is), memory plans and sizes (memory/), and the built-in SmolLM2-135M-Instruct."""
