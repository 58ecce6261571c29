"""README.md as a newcomer uses it: every code block, pasted in order into one shell on a machine that scripts/setup
set up, runs; the commands it shows are the ones that work.

The blocks are fenced: ```sh (shell commands), ```python (a script: run with the `python` that the README's PATH step
finds; ```python NAME is one the text asks to save as NAME) and ```text (what a command prints: never run). The
two set-up commands are the exception: they are what put this test on the machine (.ci/run runs `scripts/test`,
which runs this suite; tests/test_demo.py runs what `scripts/demo` runs after set-up), so they are checked, not run.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from compressors.registry import codec_grammar
from conftest import REPO
from fanstore.mount.mount import fuse_unavailable_reason

README = REPO / "README.md"
SETUP_COMMANDS = ("scripts/demo", "scripts/test")
LANGUAGES = ("sh", "python", "text")
VENV_BIN = REPO / ".venv" / "bin"
# A login shell's PATH on Debian, without the venv: the README's PATH step is what must put the commands on it.
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
RUN_TIMEOUT_S = 400  # about 60 s on a quiet 2-core machine; the rest is room for a loaded one


@dataclass(frozen=True, slots=True)
class Block:
    """One fenced code block: the README line its fence opens on, its info string and its text."""

    line: int
    info: str
    text: str

    @property
    def language(self) -> str:
        return self.info.split()[0] if self.info else ""

    @property
    def save_as(self) -> str | None:
        """The file name a ```python NAME block is saved as, before a later block runs it."""
        words = self.info.split()
        return words[1] if len(words) > 1 else None


def readme_blocks(text: str) -> list[Block]:
    """Every ``` fenced block of `text`, in order; a fence left open is an error."""
    blocks, opened, info, body = [], None, "", []
    for number, line in enumerate(text.splitlines(), 1):
        if opened is None:
            fence = re.match(r"```(.*)$", line)
            if fence:
                opened, info, body = number, fence.group(1).strip(), []
        elif line.strip() == "```":
            blocks.append(Block(opened, info, "\n".join(body) + "\n"))
            opened = None
        else:
            body.append(line)
    if opened is not None:
        raise AssertionError(f"README.md line {opened}: a code fence that never closes")
    return blocks


def runnable(blocks: list[Block]) -> list[Block]:
    return [block for block in blocks if block.language != "text" and block.text.strip() not in SETUP_COMMANDS]


def test_every_block_is_fenced_with_a_language_this_test_knows() -> None:
    """A block this test would not run could not be trusted to run: every one is sh, python or text, a text block
    is what a command prints (the codec grammar `fanstore-pack --help` shows), and no command hides in an indented
    code block, where it would be shown but never run."""
    text = README.read_text()
    blocks = readme_blocks(text)
    for block in blocks:
        assert block.language in LANGUAGES, f"README.md line {block.line}: ```{block.info}: not one of {LANGUAGES}"
        if block.language == "text":
            assert block.text.rstrip("\n") == codec_grammar().rstrip("\n"), f"README.md line {block.line}"
        if block.save_as is not None:
            assert block.language == "python" and re.fullmatch(r"[\w.-]+", block.save_as), block
    outside = re.sub(r"^```.*?^```$", "", text, flags=re.S | re.M)
    indented = re.findall(r"\n\n( {4,}\S.*)", outside)
    assert not indented, f"indented code blocks, which this test does not run: {indented}"
    for block in runnable(blocks):
        assert "/lustre" not in block.text, f"README.md line {block.line}: a path this machine does not have"


def test_setup_is_the_two_commands() -> None:
    """Exactly two set-up commands, each alone in its block: one installs and runs the demo, one installs and runs
    the tests, and CI runs the second."""
    setup = [block.text.strip() for block in readme_blocks(README.read_text()) if block.text.strip() in SETUP_COMMANDS]
    assert setup == list(SETUP_COMMANDS)
    for command in SETUP_COMMANDS:
        script = (REPO / command).read_text()
        assert os.access(REPO / command, os.X_OK), command
        assert "scripts/setup" in script, command
    assert "exec .venv/bin/fanstore demo" in (REPO / "scripts/demo").read_text()
    assert "exec .venv/bin/python -m pytest" in (REPO / "scripts/test").read_text()
    assert re.search(r"^exec scripts/test\b", (REPO / ".ci/run").read_text(), re.M)


def _missing_part() -> str | None:
    """What this machine lacks that the README's blocks need, in words, or None."""
    if not (VENV_BIN / "fanstore").exists():
        return f"no {VENV_BIN / 'fanstore'}: this checkout was not set up by scripts/setup"
    if not (VENV_BIN / "mpiexec").exists():
        return f"no {VENV_BIN / 'mpiexec'} (scripts/setup installs the mpich wheel)"
    checks = {"torch": "torch (scripts/setup installs torch==2.13.0+cpu)", "mpi4py": "mpi4py", "PIL": "Pillow"}
    for module, name in checks.items():
        found = subprocess.run([VENV_BIN / "python", "-c", f"import {module}"], capture_output=True)
        if found.returncode != 0:
            return f"{name} is not importable in .venv"
    return fuse_unavailable_reason()


def script_of(blocks: list[Block], scratch: Path) -> str:
    """One bash script that runs `blocks` in order, as pasted into one shell started in the checkout: each block
    announced on a line of its own (so a failure names its block), stopping at the first command that fails."""
    lines = ["set -e", f"cd {shlex.quote(str(REPO))}"]
    for block in blocks:
        lines.append(f"echo '@@ README.md line {block.line}'")
        if block.language == "sh":
            lines.append(block.text.rstrip("\n"))
            continue
        target = block.save_as or str(scratch / f"block-{block.line}.py")
        delimiter = "FANSTORE_README_BLOCK"
        assert delimiter not in block.text
        lines += [f"cat > {shlex.quote(target)} <<'{delimiter}'", block.text.rstrip("\n"), delimiter]
        if block.save_as is None:
            lines.append(f"python {shlex.quote(target)}")
    lines.append("echo '@@ every block ran'")
    return "\n".join(lines) + "\n"


def fuse_mounts_under(root: Path) -> list[str]:
    with open("/proc/self/mountinfo") as mountinfo:
        points = [line.split()[4] for line in mountinfo if " - fuse" in line]
    return [point for point in points if point == str(root) or point.startswith(f"{root}/")]


def test_readme_blocks_run_as_pasted(tmp_path: Path) -> None:
    """The first hour, for real: build the demo's training set, pack it, look at it, mount it, train on it with
    PyTorch through the mount and through fanstore.torch, and serve it under `mpiexec -n 2` with the same script.
    Every block must exit 0, print what its text says it shows, and leave no mount behind."""
    missing = _missing_part()
    if missing is not None:
        pytest.skip(f"the README's blocks need it: {missing}")
    blocks = runnable(readme_blocks(README.read_text()))
    home, scratch, temporary = tmp_path / "home", tmp_path / "blocks", tmp_path / "tmp"
    for folder in (home, scratch, temporary):
        folder.mkdir()
    env = {"PATH": SYSTEM_PATH, "HOME": str(home), "TMPDIR": str(temporary), "LANG": "C.UTF-8",
           "USER": os.environ.get("USER", "root")}
    started = time.monotonic()
    shell = subprocess.Popen(["bash", "-c", script_of(blocks, scratch)], env=env, cwd=REPO, stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        try:
            output, _ = shell.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(shell.pid, signal.SIGKILL)
            output, _ = shell.communicate()
            raise AssertionError(f"the README's blocks took over {RUN_TIMEOUT_S} s:\n{output[-6000:]}") from None
        left_mounted = fuse_mounts_under(tmp_path)
    finally:
        for point in fuse_mounts_under(tmp_path):  # a block failed between mount and umount
            subprocess.run(["fusermount3", "-u", "-z", point], capture_output=True)
        try:
            os.killpg(shell.pid, signal.SIGKILL)  # any daemon of this shell's session still running
        except ProcessLookupError:
            pass
    elapsed = time.monotonic() - started
    announced = re.findall(r"^@@ (.*)$", output, re.M)
    assert shell.returncode == 0 and announced[-1:] == ["every block ran"], (
        f"{announced[-1] if announced else 'the script'} failed (exit status {shell.returncode}):\n{output[-6000:]}")
    assert len(announced) == len(blocks) + 1
    assert not left_mounted, f"mounts left by the README's blocks: {left_mounted}"
    # What the text around the blocks says they show.
    version = subprocess.run([VENV_BIN / "fanstore", "--version"], capture_output=True, text=True).stdout.strip()
    assert version and version in output
    assert "demo OK" in output
    assert "the same bytes" in output  # the mount gives the original's bytes
    assert "through the mount, loss" in output
    assert re.search(r"^rank 0 of 1, epoch 1: 1488 images", output, re.M)  # train.py alone
    for rank in (0, 1):  # train.py under serve: each rank half of every epoch
        assert re.search(rf"^rank {rank} of 2, epoch 1: 744 images", output, re.M), output[-4000:]
    print(f"README blocks: {len(blocks)} ran in {elapsed:.1f} s")
