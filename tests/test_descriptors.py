"""fanstore/core/descriptors.py in a process of its own (its open file limit is process-wide): the soft limit raised
to the hard one, silently where that is enough, in one sentence where it is not; the descriptors counted."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from conftest import REPO

RAISE = r"""
import json, os, resource, sys
from fanstore.core.descriptors import descriptors_in_use, free_descriptors, raise_descriptor_limit
soft, hard = (int(limit) for limit in sys.argv[1:3])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
said = raise_descriptor_limit()
held = descriptors_in_use()
opened = [os.open(os.devnull, os.O_RDONLY) for _ in range(5)]
print(json.dumps({"said": said, "limits": resource.getrlimit(resource.RLIMIT_NOFILE), "held": held,
                  "held_after": descriptors_in_use(), "free": free_descriptors()}))
"""


def _raised(soft: int, hard: int) -> dict:
    done = subprocess.run([sys.executable, "-c", RAISE, str(soft), str(hard)], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_soft_limit_is_raised_to_the_hard_one_and_nothing_is_said_when_that_is_enough():
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the hard open file limit here is {hard}")
    seen = _raised(48, 2048)
    assert seen["said"] is None and seen["limits"] == [2048, 2048], seen
    assert seen["held_after"] == seen["held"] + 5 and seen["free"] == 2048 - seen["held_after"], seen


def test_a_hard_limit_under_what_a_daemon_wants_is_said_in_one_sentence():
    seen = _raised(48, 100)
    assert seen["limits"] == [100, 100], seen
    assert seen["said"] == ("the open file limit is 100 (`ulimit -n`; its hard limit, `ulimit -Hn`, is 100), less than "
                            "the 1024 this process wants: readers may be turned away and chunk reads fall back to "
                            "DEST; raise `ulimit -Hn` for the job"), seen
