"""Where a tensor's bytes live in this process (Linux ``/proc/self``): for tests that a
host copy is a map of a file, not a copy of it, and how many processes share it."""

from __future__ import annotations

from pathlib import Path


def mapped_file(ptr: int) -> str:
    """The file whose mapping holds address `ptr`; "[anon]" for anonymous memory."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= ptr < hi:
            return parts[5].strip() if len(parts) > 5 else "[anon]"
    return "?"


def mapping_memory(path: str) -> dict[str, int]:
    """Rss and Pss (kB) of this process's mappings of the file `path`: a page mapped by two
    processes counts whole in each one's Rss and half in each one's Pss. A page this
    process maps twice (a file mapped again as it grew) also counts twice in Rss and half
    in each mapping's Pss; "RssLargest", the Rss of its largest mapping, counts it once
    where that mapping covers the others."""
    got, inside, rss = {"Rss": 0, "Pss": 0}, False, [0]
    for line in Path("/proc/self/smaps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if "-" in parts[0] and not parts[0].endswith(":"):  # a mapping's header line
            inside = len(parts) > 5 and parts[5].strip() == path
            if inside:
                rss.append(0)
        elif inside and parts[0].rstrip(":") in got:
            got[parts[0].rstrip(":")] += int(parts[1])
            if parts[0] == "Rss:":
                rss[-1] += int(parts[1])
    return {**got, "RssLargest": max(rss)}
