"""Running a target on a CPU: the thread count (threads.py) and the format `--quant auto` picks by measuring
this CPU (choice.py)."""
