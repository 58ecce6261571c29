"""A test-only pause point: a pack (or a serve rank) stops at a named moment until told to go on, so a test can kill it, fill its
disk or look at DEST at exactly that moment, instead of polling the pack and racing it.

With FANSTORE_PAUSE_AT set to an event and FANSTORE_PAUSE_DIR to a directory, the pack writes DIR/paused (holding
the event's name) when the event comes, then waits until DIR/resume exists. Events, in order:

    walked     SRC is walked, the codecs chosen (--codec auto) and DEST prepared; nothing is journaled yet
    planned    dictionaries are trained and the journal is started
    chunk:N    N chunks are written and journaled
    index      every chunk is written; the index is not

`fanstore serve` has one, which every rank reaches:

    serve: staged   the rank's share is staged and its transport started; it has not mounted

and a mount (`fanstore mount`, a serve rank's) one:

    mount: mounted  the kernel has the mount (it is in mountinfo); the session loop has not started

Without the variables an event costs one environment lookup (a few per chunk).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

PAUSE_AT = "FANSTORE_PAUSE_AT"
PAUSE_DIR = "FANSTORE_PAUSE_DIR"


def pause_point(event: str) -> None:
    """Wait here if a test asked the pack (or serve) to pause at `event`."""
    if os.environ.get(PAUSE_AT) != event:
        return
    directory = Path(os.environ[PAUSE_DIR])
    (directory / "paused").write_text(event)
    while not (directory / "resume").exists():
        time.sleep(0.01)
