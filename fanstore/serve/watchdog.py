"""A rank's watchdog: when the rank dies, however it dies, its mount, its MPI shared-memory files, its readers' socket
and its command's processes go too.

A launcher that ends a job SIGKILLs every rank's process group (mpiexec does when one rank dies); no handler runs,
so the kernel is left with a FUSE mount whose daemon is gone (every access: ENOTCONN) and MPICH with its
/dev/shm files. The rank starts this script in a session of its own, which the launcher does not kill, holding
the write end of a pipe: when the rank is gone the read end sees end-of-file, and the watchdog lazily unmounts
the rank's own mount (if still mounted: the rank tells it the mount's device once mounted, and a mount of another
process at the same path, another job given the same MOUNTPOINT, is never touched) and removes the rank's ready
file (and its partial write), the shared-memory files it had mapped, and the socket of the node's readers once no
job holds the rank's local directory. Its output goes to a file, never the rank's stdout: a process holding that
open keeps mpiexec waiting. Then it ends what is left of the rank's command (command_processes.py): the launcher's
kill reaches the rank's process group, not a process of the command that left it.

Run as a script (`python -I -S watchdog.py`), importing only the standard library and command_processes.py beside
it (which does too), so it starts in milliseconds.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import time

if __package__:  # imported by the rank (node.py), for its path and CLEAN_EXIT
    from .command_processes import STOP_GRACE, end_command_processes, marker_of
else:  # run as the watchdog: -I leaves this script's folder off the path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from command_processes import STOP_GRACE, end_command_processes, marker_of  # noqa: E402

CLEAN_EXIT = b"clean exit"
MOUNTED = b"mounted "  # then the rank's mount's device, major:minor, and a newline
# Seconds to wait for the local directory's lock: a killed rank's goes as the kernel closes its descriptors, a moment
# after the pipe's end-of-file; a rank that closed the pipe itself (an end without the others) holds it until it exits.
LOCK_WAIT = 5.0
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def fuse_device_at(mountpoint: str) -> str | None:
    """The device (major:minor) of the topmost FUSE mount at `mountpoint`, the one an unmount there would remove."""
    device = None
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as mountinfo:
        for line in mountinfo:
            fields = line.split()
            fs_type = fields[fields.index("-") + 1]
            where = _OCTAL_ESCAPE.sub(lambda m: chr(int(m[1], 8)), fields[4])
            if where == mountpoint and (fs_type == "fuse" or fs_type.startswith("fuse.")):
                device = fields[2]
    return device


def clean_up(mountpoint: str, device: str | None, ready_file: str, left_files: list[str]) -> None:
    """Unmount the rank's own mount (`device`; None: the rank never mounted) and remove its files. A mount at
    MOUNTPOINT of another device is another process's (a job given the same MOUNTPOINT): unmounting it would pull
    that job's files from under its readers; it is left, and so is the ready file, which is that job's by now."""
    found = fuse_device_at(mountpoint)
    if found is not None and found != device:
        _say(f"rank gone: {mountpoint} holds another process's mount ({found}, not {device or 'none'}): "
             f"left alone, with {ready_file}")
        ready_file = ""
    elif found is not None:
        tool = shutil.which("fusermount3") or shutil.which("fusermount")
        command = [tool, "-u", "-z", mountpoint] if tool else ["umount", "-l", mountpoint]
        done = subprocess.run(command, capture_output=True, text=True)
        _say(f"{time.strftime('%H:%M:%S')} rank gone: unmounted {mountpoint}" if done.returncode == 0 else
             f"rank gone: {' '.join(command)} failed: {done.stderr.strip()}")
    for path in [ready_file, *left_files]:
        if path:
            _remove(path)


def _say(line: str) -> None:
    """A line of the log, in --local-dir: a note, which must not cost the clean-up it tells of. The job's own output
    may have filled that directory (a line that could not be written ended the watchdog half-way), and a path
    need not be UTF-8."""
    try:
        os.write(1, (line + "\n").encode("utf-8", "surrogateescape"))
    except OSError:
        pass


def _remove(path: str) -> None:
    """A file the rank left, said in the watchdog's log; one gone already is no matter."""
    try:
        os.unlink(path)
        _say(f"rank gone: removed {path}")
    except FileNotFoundError:
        pass
    except OSError as exc:
        _say(f"rank gone: cannot remove {path}: {exc.strerror}")


def remove_socket(socket_path: str, lock_path: str) -> None:
    """The socket of the node's readers, once the local directory's lock can be had: a job holds its directory (an
    flock, local_dir.claim_local_dir) while it serves there, so a socket found then is no live process's, and one
    that holds it by now has put its own socket there (never removed here). Where it cannot be had (a new job, no
    flock on that file system), the socket stays: the next job there replaces it, and a reader given its path is
    refused (ECONNREFUSED), which it takes as a serve process gone."""
    try:
        lock = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        deadline = time.monotonic() + LOCK_WAIT
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.01)
            except OSError:
                return
        _remove(socket_path)
    finally:
        os.close(lock)  # the lock with it


def main(argv: list[str]) -> int:
    """watchdog.py FD MOUNTPOINT READY_FILE SOCKET LOCK TOKEN [FILE ...]: wait for end-of-file on FD, then clean up.
    The FILEs are what only a killed rank leaves: MPI's shared-memory files it mapped, its ready file's partial
    write. A rank that ends normally writes CLEAN_EXIT first: it removed its ready file and socket and ended its
    command's processes, MPI its shared-memory files (and other ranks may still be finishing with them). Before
    that, once mounted, it writes MOUNTED and its mount's device, a line: the one mount this watchdog may remove."""
    fd, mountpoint, ready_file, socket_path, lock_path, token, left_files = \
        int(argv[0]), argv[1], argv[2], argv[3], argv[4], argv[5], argv[6:]
    said = b""
    while True:
        try:
            data = os.read(fd, 4096)
            said += data
            if not data:
                break
        except InterruptedError:
            continue
        except OSError:
            break
    told = said.split(b"\n")
    device = next((line[len(MOUNTED):].decode() for line in told if line.startswith(MOUNTED)), None)
    if told[-1] == CLEAN_EXIT:
        clean_up(mountpoint, device, ready_file, [])
    else:
        clean_up(mountpoint, device, ready_file, left_files)
        remove_socket(socket_path, lock_path)
        killed = end_command_processes(marker_of(token), STOP_GRACE)
        if killed:
            _say(f"rank gone: killed {len(killed)} process(es) of its command that outlived SIGTERM")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
