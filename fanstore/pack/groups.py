"""Which group a file belongs to: `--replicate GLOB` puts matching files in the group that lives on every node."""

from __future__ import annotations

import re
from typing import Any

from ..errors import UsageError, quoted

SPREAD = 0
REPLICATED = 1
# Characters a regex set gives a meaning that a glob set does not (`[^`, nested `[`, `&&`, `||`, `~~`); `-` keeps
# its meaning of a range.
_SET_SPECIAL = frozenset("\\[]^&|~")


def glob_to_regex(pattern: str) -> re.Pattern[str]:
    """Compile a path glob: `*` and `?` stay inside one path component, `**` spans any number of them."""
    # A path in the dataset has no empty or `.` component: `/val`, `./val` (written from inside SRC) and `val//cat`
    # name what `val` and `val/cat` do.
    text = "/".join(component for component in pattern.split("/") if component not in ("", "."))
    if not text:
        raise UsageError(f"--replicate: empty pattern {quoted(pattern)}")
    parts = []
    i = 0
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
            # As in fnmatch: `!` negates, and a `]` first in the set is a member, not its end.
            first = i + 2 if text.startswith("!", i + 1) else i + 1
            end = text.find("]", first + 1)
            if end < 0:
                raise UsageError(f"--replicate: unclosed '[' in pattern {quoted(pattern)}")
            members = "".join("\\" + c if c in _SET_SPECIAL else c for c in text[first:end])
            parts.append(f"[{'^' if first == i + 2 else ''}{members}]")
            i = end + 1
        else:
            parts.append(re.escape(text[i]))
            i += 1
    # A pattern naming a directory (`val`, `val/`) takes everything below it too.
    try:
        return re.compile("(?:" + "".join(parts) + r")(?:/.*)?\Z", re.DOTALL)
    except re.error as exc:  # what the translation lets through, such as a reversed range `[z-a]`
        raise UsageError(f"--replicate: pattern {quoted(pattern)} is not a valid glob: {exc.msg}") from None


class GroupPlan:
    """The groups of a pack and the rule that sends each file to one of them."""

    def __init__(self, replicate: tuple[str, ...] = ()) -> None:
        self.replicate = tuple(replicate)
        self._regexes = tuple(glob_to_regex(p) for p in self.replicate)
        self._matched: set[int] = set()  # the patterns a file given to group_of matched (the first of each file's)

    def group_of(self, path: str) -> int:
        for number, regex in enumerate(self._regexes):
            if regex.match(path):
                self._matched.add(number)
                return REPLICATED
        return SPREAD

    def unmatched(self) -> list[str]:
        """The --replicate patterns no file given to group_of matched: a typo (`vla/**`) replicates nothing."""
        return [pattern for number, pattern in enumerate(self.replicate) if number not in self._matched]

    def table(self) -> list[dict[str, Any]]:
        """The groups as the index records them."""
        groups: list[dict[str, Any]] = [{"name": "spread", "replicated": False, "patterns": []}]
        if self.replicate:
            groups.append({"name": "replicated", "replicated": True, "patterns": list(self.replicate)})
        return groups
