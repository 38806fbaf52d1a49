"""Small helper models (the real SmolLM2-135M-Instruct used by tests and demos)."""
