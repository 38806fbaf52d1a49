"""The machine's memory, read without torch (the doctor must work where torch does not import)."""

from __future__ import annotations

import os


def system_memory(path: str = "/proc/meminfo") -> tuple[int | None, int | None]:
    """(total, available) system memory in bytes; None where it cannot be read."""
    try:
        fields = {}
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    fields[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
        total, available = fields.get("MemTotal"), fields.get("MemAvailable")
        if available is None and "MemFree" in fields:
            available = fields["MemFree"] + fields.get("Cached", 0) + fields.get("Buffers", 0)
        if total is not None:
            return total, available
    except (OSError, ValueError):
        pass
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        try:
            available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            available = None
        return total, available
    except (ValueError, OSError, AttributeError):
        return None, None
