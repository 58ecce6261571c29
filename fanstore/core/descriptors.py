"""The process's file descriptors: its open file limit (RLIMIT_NOFILE), raised once by a long-lived process, and how
many it holds. One owner of that process-wide setting, as allocator.py is of malloc's.

A serve rank holds about 45 descriptors before its first reader connects (MPI's pipes, sockets and shared memory,
FUSE, its arena, its index): under a soft limit of 48, which a job script or a site may set, it had none left for
its readers or its chunk files, though the hard limit allowed 20,000. A daemon raises its soft limit to the hard
limit at start, as systemd does for its services; the soft limit is a default, the hard one the site's ceiling.
"""

from __future__ import annotations

import os
import resource

# Descriptors a daemon wants at the least: the usual default soft limit. Below it, once raised as far as the hard
# limit allows, the process says so (readers may be turned away, chunk reads fall back to DEST).
ENOUGH = 1024
# The most it raises the soft limit to (Linux's default nr_open). Some container runtimes set a hard limit of 2^30 or
# unlimited, and a soft limit that high slows whatever loops over every possible descriptor (closing them before an
# exec, say) or sizes a table by it: MPI starts after the raise, and COMMAND inherits it.
CEILING = 1 << 20
_NR_OPEN = "/proc/sys/fs/nr_open"  # the most the kernel lets a process be allowed


def raise_descriptor_limit(enough: int = ENOUGH) -> str | None:
    """Raise this process's soft open file limit to its hard limit (CEILING at most), before anything sizes its pools
    by it. Returns a sentence for the log where that is below `enough`; else None."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(CEILING, _kernel_ceiling()) if hard == resource.RLIM_INFINITY else min(hard, CEILING)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass
    raised = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if raised == resource.RLIM_INFINITY or raised >= enough:
        return None
    return (f"the open file limit is {raised} (`ulimit -n`; its hard limit, `ulimit -Hn`, is "
            f"{'unlimited' if hard == resource.RLIM_INFINITY else hard}), less than the {enough} this process "
            f"wants: readers may be turned away and chunk reads fall back to DEST; raise `ulimit -Hn` for the job")


def _kernel_ceiling() -> int:
    try:
        with open(_NR_OPEN) as ceiling:
            return int(ceiling.read())
    except (OSError, ValueError):
        return CEILING


def descriptor_limit() -> int | None:
    """This process's soft open file limit; None where unlimited."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def free_descriptors() -> int | None:
    """Descriptors this process may still open; None where its limit is unlimited."""
    limit = descriptor_limit()
    return None if limit is None else max(0, limit - descriptors_in_use())


def descriptors_in_use() -> int:
    """Descriptors this process holds now (0 where /proc cannot tell): what a pool sized by the limit must leave."""
    try:
        return max(0, len(os.listdir("/proc/self/fd")) - 1)  # the listing's own descriptor aside
    except OSError:
        return 0
