"""Which group a file belongs to: `--replicate GLOB` puts matching files in the group that lives on every node."""

from __future__ import annotations

import re
from typing import Any

from .errors import UsageError

SPREAD = 0
REPLICATED = 1


def glob_to_regex(pattern: str) -> re.Pattern[str]:
    """Compile a path glob: `*` and `?` stay inside one path component, `**` spans any number of them."""
    if not pattern.strip("/"):
        raise UsageError(f"--replicate: empty pattern {pattern!r}")
    parts = []
    i = 0
    text = pattern.strip("/")
    while i < len(text):
        if text.startswith("**/", i):
            parts.append("(?:.*/)?")
            i += 3
        elif text.startswith("**", i):
            parts.append(".*")
            i += 2
        elif text[i] == "*":
            parts.append("[^/]*")
            i += 1
        elif text[i] == "?":
            parts.append("[^/]")
            i += 1
        elif text[i] == "[":
            end = text.find("]", i + 2)
            if end < 0:
                raise UsageError(f"--replicate: unclosed '[' in pattern {pattern!r}")
            body = text[i + 1 : end]
            if body.startswith("!"):
                body = "^" + body[1:]
            parts.append(f"[{body.replace(chr(92), chr(92) * 2)}]")
            i = end + 1
        else:
            parts.append(re.escape(text[i]))
            i += 1
    # A pattern naming a directory (`val`, `val/`) takes everything below it too.
    return re.compile("(?:" + "".join(parts) + r")(?:/.*)?\Z", re.DOTALL)


class GroupPlan:
    """The groups of a pack and the rule that sends each file to one of them."""

    def __init__(self, replicate: tuple[str, ...] = ()) -> None:
        self.replicate = tuple(replicate)
        self._regexes = tuple(glob_to_regex(p) for p in self.replicate)

    def group_of(self, path: str) -> int:
        return REPLICATED if any(rx.match(path) for rx in self._regexes) else SPREAD

    def table(self) -> list[dict[str, Any]]:
        """The groups as the index records them."""
        groups: list[dict[str, Any]] = [{"name": "spread", "replicated": False, "patterns": []}]
        if self.replicate:
            groups.append({"name": "replicated", "replicated": True, "patterns": list(self.replicate)})
        return groups
