"""Memory planning from config.json files alone, before any download: parameter counts (params.py), bytes per
format (sizes.py), the one-device plan (plan.py), the per-device split (split.py) and the check before
loading (preflight.py)."""
