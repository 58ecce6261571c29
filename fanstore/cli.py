"""Command line: `fanstore-pack` and `fanstore {pack,select,verify,info,plan,mount,umount,demo,serve}`: the options
and their help; what each command does is commands.py's.

Every expected failure is a FanstoreError and ends as one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any, Sequence

from . import commands
from .core.options import add_option
from .errors import EXIT_DOES_NOT_FIT, EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, DoesNotFit, FanstoreError, \
    Terminated, UsageError, quoted, say_line

EPILOG_WIDTH = 78  # columns of the exit statuses, as argparse wraps the rest of --help for an 80-column terminal
_ERROR = (EXIT_FAILURE, "an error, said in one line on stderr")
_USAGE = (EXIT_USAGE, "the command line is wrong (a usage message says how)")
_INTERRUPTED = (EXIT_INTERRUPTED, "interrupted (Ctrl-C, or SIGTERM)")


def package_version() -> str:
    """fanstore's version: the installed distribution's, else (run from a checkout) pyproject.toml's."""
    from importlib import metadata

    try:
        return metadata.version("fanstore")
    except metadata.PackageNotFoundError:
        pass
    import tomllib

    try:
        with open(Path(__file__).resolve().parent.parent / "pyproject.toml", "rb") as pyproject:
            return str(tomllib.load(pyproject)["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"


class _HelpFormatter(argparse.HelpFormatter):
    """A description (one paragraph) wrapped to the terminal, as argparse wraps the rest; an epilog (exit statuses,
    an example, the codec grammar: several lines) kept as laid out, its columns and the example's line whole."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" not in text:
            return super()._fill_text(text, width, indent)
        return "".join(indent + line for line in text.splitlines(keepends=True))


class _VersionAction(argparse.Action):
    """--version: the version is looked up only when asked (importlib.metadata is no light import for every run)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0,
                         help="print fanstore's version and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"{parser.prog} {package_version()}")
        parser.exit()


def _command_help(description: str, exits: Sequence[tuple[int | str, str]], example: str,
                  more: str = "") -> dict[str, Any]:
    """A command's --help beyond its options, as keywords for its parser: the description (one paragraph), then
    `more`, the exit statuses and an example, laid out here."""
    import textwrap

    width = max(len(str(status)) for status, _ in exits) + 2
    statuses = "\n".join(textwrap.fill(meaning, EPILOG_WIDTH, initial_indent=f"  {status!s:<{width}}",
                                        subsequent_indent=" " * (width + 2)) for status, meaning in exits)
    epilog = f"{more}\n\n" if more else ""
    epilog += f"exit status:\n{statuses}\n\nexample:\n  {example}"
    return {"description": description, "epilog": epilog, "formatter_class": _HelpFormatter}


def _pack_help(prog: str) -> dict[str, Any]:
    """fanstore-pack's and `fanstore pack`'s --help, the codec grammar included (compressors.registry's)."""
    from compressors.registry import codec_grammar

    from .pack.options import AUTO_CODEC

    grammar = "\n".join(f"  {line}" for line in codec_grammar().splitlines())
    return _command_help(
        "Pack the directory tree SRC into the dataset directory DEST: each file compressed on its own, so that any "
        "file reads without its neighbours, into chunk files and an index written last. SRC may instead be one or "
        "more archives (tar, tar.gz, tar.zst, tar.bz2, tar.xz, zip) or a quoted glob of them ('shards/*.tar'): "
        "their members are packed as the files of an extraction, read as a stream, nothing extracted; a damaged "
        "archive gives its members before the damage and a warning naming the offset. DEST is new or empty; or "
        "an interrupted pack of the same SRC with the same options, which this resumes from its last finished chunk "
        "to the bytes an uninterrupted pack gives; or this very pack, finished, and there is nothing to do. "
        "Another dataset is replaced only with --force, and what fanstore did not write never. Files that cannot be "
        "packed (unreadable, fifos, links that leave SRC, member names such as ../x, ...) are skipped with a "
        "warning, and `fanstore info DEST` lists them.",
        [(0, "packed; or DEST already held this very pack, finished (nothing to do)"),
         (EXIT_FAILURE, "an error, said in one line on stderr: a bad option, a DEST it may not use, a file that "
                        "cannot be packed with --strict, a full disk (what was finished stays: the same command "
                        "resumes)"),
         _USAGE,
         (EXIT_DOES_NOT_FIT, "--fit cannot be met: refused before anything is written, stopped while packing "
                             "once it can no longer fit (what it wrote is removed), or DEST as packed is larger "
                             "than --fit"),
         (EXIT_INTERRUPTED, "interrupted (Ctrl-C, or SIGTERM): the same command resumes")],
        f"{prog} /data/imagenet /scratch/imagenet.fanstore --codec zstd:3 --replicate 'val/**'",
        more=f"codec specs (--codec SPEC, unless {AUTO_CODEC}):\n{grammar}\n  A file that would not shrink is stored "
             "as it is.")


def _add_pack_arguments(parser: argparse.ArgumentParser) -> None:
    from .pack.options import PackOptions

    parser.add_argument("src", metavar="SRC", nargs="+",
                        help="directory tree to pack (it is only read), or one or more archives or globs of them")
    parser.add_argument("dest", metavar="DEST",
                        help="dataset directory to write: new, empty, an interrupted pack to resume, or this pack "
                             "finished")
    for name in ("codec", "chunk_size", "replicate", "block_size", "blocks_above", "workers", "strict", "force"):
        add_option(parser, PackOptions, name)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_selection_arguments(parser, auto_only=True)


def _add_selection_arguments(parser: argparse.ArgumentParser, auto_only: bool) -> None:
    from .pack.options import PackOptions

    with_auto = "; with --codec auto" if auto_only else ""
    add_option(parser, PackOptions, "budget", more=with_auto)
    add_option(parser, PackOptions, "prefetch_threads")
    add_option(parser, PackOptions, "fit", more=f"; exit status {EXIT_DOES_NOT_FIT} when it cannot{with_auto}")
    parser.add_argument("--nodes", metavar="N",  # read by commands.py: its bound is the placement's (serve/)
                        help="with --fit: the dataset is served by N nodes, each storing the replicated groups and "
                             "its share of the rest, so --fit is per node")
    for name in ("tolerance", "pack_speed", "sample", "seed"):
        add_option(parser, PackOptions, name)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but a negative value given to an option (`--budget -5MB/s`, `--fit -1GB`) is its value, for
    the option's own check to refuse in one line naming it: argparse takes only a plain number such as -2 so, and
    said `argument --budget: expected one argument` beneath the usage."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = _NEGATIVE_VALUE  # subparsers are made of this class too


_NEGATIVE_VALUE = re.compile(r"^-\.?\d")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fanstore", **_command_help(
        "Compressed, read-only training datasets: pack a directory tree once, then read any file of it fast, "
        "through a mount, the Python API (fanstore.open_dataset) or, across the nodes of a job, `fanstore serve`. "
        "`fanstore COMMAND --help` says more of each command. Sizes are printed in SI units (kB, MB, GB: powers of "
        "1000), as speeds are in MB/s; a SIZE option takes either kind: 64MB, or 64MiB for powers of 1024.",
        [(0, "the command did what it was asked"), _ERROR, _USAGE,
         ("other", "each command's --help lists its own")],
        "fanstore demo"))
    parser.add_argument("--version", action=_VersionAction)
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    pack_parser = subcommands.add_parser("pack", help="pack a directory tree into a dataset (as fanstore-pack)",
                                      **_pack_help("fanstore pack"))
    _add_pack_arguments(pack_parser)
    pack_parser.set_defaults(run=commands.run_pack)
    _add_select_parser(subcommands)
    _add_dataset_parsers(subcommands)
    _add_mount_parsers(subcommands)
    _add_demo_parser(subcommands)
    _add_serve_parser(subcommands)
    for command_parser in subcommands.choices.values():
        command_parser.set_defaults(command_parser=command_parser)
    return parser


def _add_select_parser(subcommands: Any) -> None:
    select_parser = subcommands.add_parser(
        "select", help="measure codecs on a sample of SRC and choose per file kind", **_command_help(
            "Measure every codec setting on a sample of SRC, on this machine, and choose one per file kind (JPEG, "
            "PNG, .npy arrays, text, ...): the one that stores least while decoding at least --budget (each of K "
            "--prefetch-threads needs only budget/K), or, with --fit SIZE, the ones that decode fastest while the "
            "whole dataset fits in SIZE. Prints every candidate with the choice marked, then the predicted stored "
            "size and pack time; nothing is written but --plot's file. `fanstore-pack --codec auto` with the same "
            "options chooses the same way, and packs with its choice.",
            [(0, "chosen, and printed"), (EXIT_FAILURE, "an error, said in one line on stderr (SRC unreadable, a bad "
                                                        "option, neither --budget nor --fit given)"),
             _USAGE, (EXIT_DOES_NOT_FIT, "--fit cannot be met, not even with the strongest settings"), _INTERRUPTED],
            "fanstore select /data/imagenet --budget 800MB/s --prefetch-threads 4 --replicate 'val/**'"))
    select_parser.add_argument("src", metavar="SRC",
                               help="the directory tree to pack (it is only read), or an archive or a glob of them")
    _add_selection_arguments(select_parser, auto_only=False)
    from .pack.options import SELECT_HELP, PackOptions

    for name in ("replicate", "workers"):
        add_option(select_parser, PackOptions, name, help=SELECT_HELP[name])
    select_parser.add_argument("--plot", metavar="FILE.png",
                               help="draw ratio against decode throughput, and stored size against pack time")
    select_parser.set_defaults(run=commands.run_select)


def _add_dataset_parsers(subcommands: Any) -> None:
    """verify, info and plan: commands over a packed dataset's index and chunks."""
    verify_parser = subcommands.add_parser(
        "verify", help="check and decode every file; list the bad ones", **_command_help(
            "Check the dataset DEST whole: every chunk file's header and size, and every file's stored bytes "
            "against the index's checksum, decoded to the size the index records. Lists each bad chunk file and "
            "each bad file (only the files of a bad chunk are lost), then a count. Run it on a dataset copied or "
            "staged by other means, or when reads fail.",
            [(0, "every file and every chunk file is good"),
             (EXIT_FAILURE, "a bad file or chunk file was found (listed on stdout), or DEST cannot be opened (said "
                            "in one line on stderr)"),
             _USAGE, _INTERRUPTED],
            "fanstore verify /scratch/imagenet.fanstore"))
    verify_parser.add_argument("dest", metavar="DEST", help="the dataset directory (its fanstore.index and chunks/)")
    verify_parser.set_defaults(run=commands.run_verify)
    info_parser = subcommands.add_parser(
        "info", help="version, groups, codecs, counts, sizes and ratio", **_command_help(
            "Describe the dataset DEST from its index: format version; counts of files, directories and symlinks; "
            "raw and stored bytes and the ratio; chunks; chunk files missing or not as indexed (their headers and "
            "sizes only: `fanstore verify` reads every file); the groups (spread or replicated) and codecs, with "
            "files and bytes for each; the options it was packed with and the paths the pack skipped; with "
            "--codec auto, what the selector chose and predicted.",
            [(0, "described (damaged chunk files, if any, are listed)"),
             (EXIT_FAILURE, "DEST cannot be opened: no dataset there, or an index this version cannot read (said "
                            "in one line on stderr)"),
             _USAGE],
            "fanstore info /scratch/imagenet.fanstore --all-skipped"))
    info_parser.add_argument("dest", metavar="DEST", help="the dataset directory (its fanstore.index and chunks/)")
    info_parser.add_argument("--all-skipped", action="store_true",
                             help="list every path the pack skipped (by default the first 50, and how many more)")
    info_parser.set_defaults(run=commands.run_info)
    plan_parser = subcommands.add_parser(
        "plan", help="what each node of an N-node job stores, and whether it fits its local storage",
        **_command_help(
            "Print, from the index alone, how an N-node job (`fanstore serve`) places the dataset: bytes stored per "
            "node, replicated bytes, chunks split between nodes, bytes read from DEST to stage the job; with "
            "--local-capacity, whether the fullest node's share fits.",
            [(0, "every node's share fits in --local-capacity (or none is given)"),
             _ERROR, _USAGE, (EXIT_DOES_NOT_FIT, "the fullest node's share does not fit in --local-capacity")],
            "fanstore plan /scratch/imagenet.fanstore --nodes 64 --local-capacity 1.5TiB"))
    plan_parser.add_argument("dest", metavar="DEST", help="the dataset directory (its index is all that is read)")
    plan_parser.add_argument("--nodes", required=True, metavar="N", help="nodes in the job, 1 to 4096")
    plan_parser.add_argument("--local-capacity", metavar="SIZE",
                             help="local storage each node has for the dataset, e.g. 1.5TiB")
    plan_parser.set_defaults(run=commands.run_plan)


def _add_mount_parsers(subcommands: Any) -> None:
    mount_parser = subcommands.add_parser(
        "mount", help="show the dataset as a read-only directory (FUSE)", **_command_help(
            "Show the dataset DEST at MOUNTPOINT as an ordinary read-only directory (FUSE), each file decoded when "
            "read, with a bounded cache of decoded files and prefetch. A daemon serves the mount in the "
            "background, logging to --log, and the command returns once the mount answers; `fanstore umount "
            "MOUNTPOINT` (or SIGTERM to the daemon) ends it. --foreground serves in this process instead, until "
            "unmounted, SIGTERM or Ctrl-C.",
            [(0, "mounted (with --foreground: served, then unmounted)"),
             (EXIT_FAILURE, "an error, said in one line on stderr: DEST is no dataset, MOUNTPOINT is missing or in "
                            "use or inside the dataset, FUSE is unavailable, the daemon could not start"),
             _USAGE, (EXIT_INTERRUPTED, "interrupted (Ctrl-C, or SIGTERM) before the mount answered")],
            "fanstore mount /scratch/imagenet.fanstore /tmp/imagenet --cache-size 4GiB"))
    mount_parser.add_argument("dest", metavar="DEST", help="the dataset directory (its fanstore.index and chunks/)")
    mount_parser.add_argument("mountpoint", metavar="MOUNTPOINT",
                              help="an existing empty directory, outside the dataset, where its files appear")
    mount_parser.add_argument("--foreground", action="store_true",
                              help="serve in this process until unmounted, logging to stderr (or --log)")
    from .mount.options import MountOptions

    for name in ("cache_size", "prefetch", "prefetch_min_size", "prefetch_list", "allow_other"):
        add_option(mount_parser, MountOptions, name)
    mount_parser.add_argument("--log", metavar="FILE",
                              help="daemon log (default: mount-PATH-DIGEST.log, named after MOUNTPOINT's whole "
                                   "path, in $XDG_RUNTIME_DIR/fanstore or, without it, ~/.cache/fanstore; with "
                                   "--foreground, stderr)")
    for name in ("keep_cache", "kernel_timeout"):
        add_option(mount_parser, MountOptions, name)
    mount_parser.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    mount_parser.set_defaults(run=commands.run_mount)
    umount_parser = subcommands.add_parser(
        "umount", help="unmount a fanstore mount (live or stale)", **_command_help(
            "Unmount the fanstore mount at MOUNTPOINT, live or stale (one whose daemon was killed), lazily "
            "(fusermount3 -u -z, or umount -l where there is no fusermount): files open through it stay readable "
            "until closed, and the daemon then exits by itself.",
            [(0, "unmounted"),
             (EXIT_FAILURE, "an error, said in one line on stderr: nothing is mounted at MOUNTPOINT, or another "
                            "file system than fanstore's, it does not exist, or the unmount failed"),
             _USAGE],
            "fanstore umount /tmp/imagenet"))
    umount_parser.add_argument("mountpoint", metavar="MOUNTPOINT", help="where `fanstore mount` mounted the dataset")
    umount_parser.set_defaults(run=commands.run_umount)


def _add_demo_parser(subcommands: Any) -> None:
    demo_parser = subcommands.add_parser(
        "demo", help="build, pack, mount and read back a small training dataset; train on it through the mount",
        **_command_help(
            "Build a small training set (digit PNGs and photo crops from scikit-learn, float32 fields, labels), "
            "pack it and read every file back through the Python API; then, where FUSE is there, through a mount "
            "(two timed epochs, and a small model trained on it as on the original directory); with torch, train a "
            "small CNN from the original, through fanstore.torch and through the mount; with mpi4py and mpiexec, "
            "serve it on two ranks of this machine. Every reader must give back the original bytes; a table "
            "compares their speeds with the plain directory's. A part whose requirement is missing is skipped, "
            "saying why.",
            [(0, "every file read back equals its original"),
             (EXIT_FAILURE, "a file read back differs or is missing (listed), or an error said in one line on "
                            "stderr"),
             _USAGE, _INTERRUPTED],
            "fanstore demo --workdir /tmp/fanstore-demo"))
    demo_parser.add_argument("--workdir", metavar="DIR",
                             help="keep the demo's files here: its source tree, the dataset, the mount's log "
                                  "(default: a temporary directory, removed at the end)")
    demo_parser.add_argument("--scale", type=int, default=1, metavar="N",
                             help="N times as many photo crops and float32 fields (the 1,797 digits stay as "
                                  "they are; default 1)")
    demo_parser.add_argument("--no-mount", action="store_true",
                             help="read through the Python API only: no mount, no serve")
    demo_parser.set_defaults(run=commands.run_demo)


def _add_serve_parser(subcommands: Any) -> None:
    serve_parser = subcommands.add_parser(
        "serve", help="under mpiexec or srun (one rank per node): stage, mount everywhere, run -- COMMAND",
        usage="mpiexec -n N fanstore serve DEST MOUNTPOINT --local-dir DIR [options] [-- COMMAND ...]",
        **_command_help(
            "Spread DEST's chunks over the job's nodes (replicated groups on every node), stage each node's share "
            "into --local-dir, and mount the whole dataset at MOUNTPOINT on every node; files stored on another "
            "node come from it over MPI. With -- COMMAND, run COMMAND on every rank once all are mounted "
            "(FANSTORE_MOUNT, FANSTORE_RANK, FANSTORE_SIZE in its environment), then end what it left running, "
            "unmount and exit with the worst status; without, write MOUNTPOINT.ready once all are mounted and serve "
            "until SIGTERM. {rank} in MOUNTPOINT, --local-dir and --ready-file gives each rank its own path (several "
            "ranks on one host).",
            [(0, "every rank's COMMAND exited 0; without COMMAND, the job served until SIGTERM and unmounted"),
             (EXIT_FAILURE, "a rank could not start, stage or mount (each rank stops, and says why in one line), "
                            "or a rank was lost"),
             _USAGE,
             ("N", "the highest status of any rank's COMMAND: 128+S for one killed by signal S, 127 for one not "
                   "found, 126 for one found but not runnable (as a shell says)"),
             (EXIT_INTERRUPTED, "Ctrl-C (SIGINT) before every rank was mounted"),
             (128 + signal.SIGTERM, "SIGTERM before every rank was mounted")],
            "srun --ntasks-per-node=1 fanstore serve /lustre/imagenet.fanstore /tmp/imagenet --local-dir "
            "$TMPDIR/fs -- python main.py -a resnet50 /tmp/imagenet"))
    serve_parser.add_argument("dest", metavar="DEST", help="the packed dataset, on the shared file system")
    serve_parser.add_argument("mountpoint", metavar="MOUNTPOINT", help="an existing empty directory on each node")
    from .serve.options import SERVE_MOUNT, SERVE_MOUNT_HELP, PeerOptions, ServeOptions

    for name in ("local_dir", "stats", "ready_file"):
        add_option(serve_parser, ServeOptions, name)
    for name in ("timeout", "retry_after", "lost_after", "max_in_flight"):  # how a rank asks its peers
        add_option(serve_parser, PeerOptions, name)
    for name in ("doorbell", "loop_requests"):
        add_option(serve_parser, ServeOptions, name)
    for name in ("prefetch_list", "prefetch", "prefetch_threads", "cache_size", "allow_other"):
        add_option(serve_parser, SERVE_MOUNT, name, help=SERVE_MOUNT_HELP[name])
    add_option(serve_parser, ServeOptions, "progress")
    serve_parser.set_defaults(run=commands.run_serve, job_command=[])


def _raise_interrupt(signum: int, frame: object) -> None:
    raise Terminated


def _run(prog: str, parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    job_command: list[str] | None = None
    if argv[:1] == ["serve"] and "--" in argv:  # everything after `--` is the job's command, options and all
        split = argv.index("--")
        argv, job_command = argv[:split], argv[split + 1 :]
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said with the command's own usage: the top parser's would say nothing of its options
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if job_command == []:  # `-- $TRAIN` with TRAIN unset: serving until SIGTERM would hold the nodes to the end
        getattr(args, "command_parser", parser).error("argument COMMAND: `--` with no command after it (an unset "
                                                      "variable?); leave `--` out to serve until SIGTERM")
    if job_command:
        args.job_command = job_command
    args.argv = argv  # a background mount re-runs itself with the same arguments
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        _check_paths(args, getattr(args, "command_parser", parser))
        return args.run(args)
    except DoesNotFit as exc:
        say_line(f"{prog}: error: {exc}")
        return EXIT_DOES_NOT_FIT
    except FanstoreError as exc:
        say_line(f"{prog}: error: {exc}")
        return EXIT_FAILURE
    except KeyboardInterrupt as exc:
        resumable = args.run is commands.run_pack
        say_line(f"{prog}: interrupted" + ("; run the same command again to resume" if resumable else ""))
        return 128 + signal.SIGTERM if isinstance(exc, Terminated) and args.run is commands.run_serve \
            else EXIT_INTERRUPTED
    except BrokenPipeError as exc:
        if not _stdout_closed():  # another pipe (a child's, a socket's) closed under us: say so, it is a fault
            say_line(f"{prog}: error: {exc.strerror or 'Broken pipe'}: a pipe or socket it wrote to was closed "
                     f"by its other end")
            return EXIT_FAILURE
        # The reader of our output went away (`fanstore select SRC | head`): not an error worth a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE


# Every path a command takes, by its argument's name on the command line: what _check_paths looks at.
_PATH_ARGUMENTS = {"src": "SRC", "dest": "DEST", "mountpoint": "MOUNTPOINT", "log": "--log", "plot": "--plot",
                   "workdir": "--workdir", "local_dir": "--local-dir", "ready_file": "--ready-file",
                   "prefetch_list": "--prefetch-list"}
_EMPTY_MEANS_NONE = {"--prefetch-list"}  # "" is no list, as not giving it


def _check_paths(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse a path no command can use, before the command runs. An empty one ("$DEST" with DEST unset) was
    Path(''), the current directory, where the system calls take '' for no file: a pack wrote its chunks there, a
    mount covered it. A relative one in a current directory that was removed failed in a traceback out of
    os.getcwd; an absolute one still works."""
    given = []
    for field, name in _PATH_ARGUMENTS.items():
        value = getattr(args, field, None)
        given += [(name, text) for text in (value if isinstance(value, list) else [value]) if text is not None]
    for name, text in given:
        if text == "" and name not in _EMPTY_MEANS_NONE:
            parser.error(f"argument {name}: an empty path (an unset variable?)")
    relative = [(name, text) for name, text in given if text and not text.startswith("/")]
    if relative:
        try:
            os.getcwd()
        except FileNotFoundError:
            name, text = relative[0]
            raise UsageError(f"{name} {quoted(text)} is relative to the current directory, which was removed: cd "
                             "to a directory that exists, or give an absolute path") from None


def _stdout_closed() -> bool:
    """Whether the reader of stdout has gone (a pipe's read end closed: poll says POLLERR), or stdout is no file."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError):
        return True


def main(argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    """`fanstore`; `parser` is _build_parser's, made already (by __main__, while an interrupt waits)."""
    return _run("fanstore", parser or _build_parser(), argv)


def pack_main(argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    """`fanstore-pack`; `parser` is _build_pack_parser's, made already."""
    return _run("fanstore-pack", parser or _build_pack_parser(), argv)


def _build_pack_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fanstore-pack", **_pack_help("fanstore-pack"))
    parser.add_argument("--version", action=_VersionAction)
    _add_pack_arguments(parser)
    parser.set_defaults(run=commands.run_pack)
    return parser


# Each entry point's parser: building one imports what its options need (numpy with the pack's), so __main__ builds
# it while SIGINT waits, as it imports this module.
PARSERS = {"main": _build_parser, "pack_main": _build_pack_parser}


if __name__ == "__main__":
    sys.exit(main())
