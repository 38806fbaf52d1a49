"""Model management without torch: names and the registry, the Hugging Face hub, memory plans and sizes,
and the built-in SmolLM2-135M-Instruct."""
