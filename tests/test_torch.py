"""fanstore.torch: Datasets that read a packed dataset without FUSE, in DataLoader workers, with and without the
EpochSampler's decoding ahead; and under a real `mpiexec -n 2 fanstore serve`."""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO
import fanstore
from fanstore import PackOptions, pack
from fanstore.core.format import INDEX_NAME

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/setup installs torch==2.13.0+cpu)")
from torch.utils.data import DataLoader, RandomSampler  # noqa: E402

from fanstore.torch import EpochSampler, FileDataset, ImageFolder, reading  # noqa: E402

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def make_image_tree(root: Path) -> None:
    """Classes with nested folders, upper-case extensions, a file that is not an image, a link to a folder."""
    from PIL import Image

    rng = np.random.default_rng(5)
    layout = {"cat": ["a.png", "b.JPG", "sub/c.png", "sub/deeper/d.png", "notes.txt"],
              "dog": ["z.png", "a_b/e.png", "a.png"], "emu": ["only.webp"]}
    for label, names in layout.items():
        for name in names:
            path = root / "train" / label / name
            path.parent.mkdir(parents=True, exist_ok=True)
            if name.endswith(".txt"):
                path.write_text("not an image")
                continue
            image = Image.fromarray(rng.integers(0, 255, (8, 8, 3), np.uint8))
            buffer = io.BytesIO()
            image.save(buffer, format={"png": "PNG", "jpg": "JPEG", "webp": "WEBP"}[name.rsplit(".", 1)[1].lower()])
            path.write_bytes(buffer.getvalue())
    (root / "extra").mkdir()
    (root / "extra" / "x.png").write_bytes((root / "train" / "dog" / "z.png").read_bytes())
    os.symlink("../../extra", root / "train" / "emu" / "linked")
    (root / "train" / "README").write_text("a file beside the classes")


def torchvision_samples(root: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """What torchvision's ImageFolder lists (datasets.folder.find_classes and make_dataset), relative to root."""
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    samples = []
    for index, name in enumerate(classes):
        for folder, _, files in sorted(os.walk(root / name, followlinks=True)):
            for file in sorted(files):
                if file.lower().endswith(IMG_EXTENSIONS):
                    samples.append((os.path.relpath(os.path.join(folder, file), root.parent), index))
    return classes, samples


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("torch")
    src = base / "src"
    rng = np.random.default_rng(3)
    for i in range(60):
        path = src / "files" / f"d{i % 3}" / f"f{i:03d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.integers(0, 8, 1000 + 97 * i, np.uint8).tobytes())
    make_image_tree(src)
    pack(src, base / "dest", PackOptions(codec="zstd:3", chunk_size=16 * 1024, workers=1))
    return src, base / "dest"


def test_file_dataset_lists_every_regular_file_sorted_and_opens_nothing_until_used(packed, tmp_path):
    src, dest = packed
    dataset = FileDataset(dest)
    assert "_process_reading" not in vars(dataset)
    expected = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file() and not p.is_symlink())
    assert dataset.paths == expected and len(dataset) == len(expected)
    assert len(pickle.dumps(dataset)) < 1000  # the recipe travels, not the paths or the index
    never_opened = FileDataset(tmp_path / "nowhere")  # nothing is opened yet, so nothing fails yet
    with pytest.raises(Exception, match="nowhere"):
        len(never_opened)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_every_item_is_the_original_bytes_in_two_workers(packed, context):
    src, dest = packed
    paths = [f"files/d{i % 3}/f{i:03d}.bin" for i in range(60)]
    dataset = FileDataset(dest, paths=paths)
    loader = DataLoader(dataset, batch_size=7, num_workers=2, collate_fn=list, multiprocessing_context=context)
    got = [data for batch in loader for data in batch]
    assert got == [(src / path).read_bytes() for path in paths]


def test_forked_workers_take_the_parents_items_instead_of_looking_the_paths_up_again(packed, monkeypatch):
    src, dest = packed
    paths = [f"files/d{i % 3}/f{i:03d}.bin" for i in range(60)]
    dataset = FileDataset(dest, paths=paths)
    assert len(dataset) == 60  # the sampler asks this in the training process: it opens the dataset there

    def looked_up(*args, **kwargs):
        raise AssertionError("a forked worker looked the paths up again")

    from fanstore.core.api import Dataset

    monkeypatch.setattr(Dataset, "resolve_many", looked_up)
    monkeypatch.setattr(Dataset, "resolve", looked_up)
    loader = DataLoader(dataset, batch_size=7, num_workers=2, collate_fn=list, multiprocessing_context="fork")
    assert [data for batch in loader for data in batch] == [(src / path).read_bytes() for path in paths]


def _two_files_packed(tmp_path: Path) -> tuple[Path, Path]:
    """A dataset of files b and c, which a test packs again in place after changing them."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("b", "c"):
        (src / name).write_bytes(name.encode() * 100)
    dest = tmp_path / "dest"
    pack(src, dest, PackOptions(codec="zstd:3", workers=1))
    return src, dest


def test_forked_workers_look_the_paths_up_again_when_the_dataset_changed_on_disk(tmp_path):
    src, dest = _two_files_packed(tmp_path)
    dataset = FileDataset(dest, paths=["b", "c"])
    assert len(dataset) == 2  # opened in this process, then the dataset is packed again in place
    (src / "a").write_bytes(b"a new first file, which moves every entry number")
    (src / "c").write_bytes(b"c, rewritten")
    pack(src, dest, PackOptions(codec="zstd:3", workers=1, force=True))
    loader = DataLoader(dataset, batch_size=1, num_workers=1, collate_fn=list, multiprocessing_context="fork")
    assert [data for batch in loader for data in batch] == [b"b" * 100, b"c, rewritten"]


def test_a_spawned_worker_gets_entry_numbers_not_the_paths(packed):
    """A worker started by spawn unpickles the dataset: given paths travel as 4-byte entry numbers of the index
    file the training process looked them up in (issue 35: a list of 10^7 paths cost each worker gigabytes and a
    lookup of every path), and the paths are listed again only if asked for."""
    src, dest = packed
    paths = [f"files/d{i % 3}/f{i:03d}.bin" for i in reversed(range(60))]
    dataset = FileDataset(dest, paths=paths)
    assert len(dataset) == 60  # the sampler asks this in the training process: it opens the dataset there
    pickled = pickle.dumps(dataset)
    half = FileDataset(dest, paths=paths[:30])
    assert len(half) == 30
    assert b"f059.bin" not in pickled and len(pickled) - len(pickle.dumps(half)) <= 30 * 4 + 8  # 4 bytes an item
    worker = pickle.loads(pickled)
    assert [worker[i] for i in (0, 59)] == [(src / paths[0]).read_bytes(), (src / paths[59]).read_bytes()]
    assert worker.paths == paths
    loader = DataLoader(dataset, batch_size=7, num_workers=2, collate_fn=list, multiprocessing_context="spawn")
    assert [data for batch in loader for data in batch] == [(src / path).read_bytes() for path in paths]


def test_a_spawned_worker_refuses_entry_numbers_of_an_index_packed_again(tmp_path):
    src, dest = _two_files_packed(tmp_path)
    dataset = FileDataset(dest, paths=["c"])
    assert len(dataset) == 1
    pickled = pickle.dumps(dataset)
    (src / "a").write_bytes(b"a new first file, which moves every entry number")
    pack(src, dest, PackOptions(codec="zstd:3", workers=1, force=True))
    worker = pickle.loads(pickled)
    refusal = re.escape(f"{dest / INDEX_NAME}: not the index file") + ".*packed again"
    with pytest.raises(fanstore.UsageError, match=refusal):
        worker[0]


def test_forked_workers_open_nothing_again_every_epoch(tmp_path, monkeypatch):
    """A DataLoader forks its workers afresh each epoch; on a shared file system each opening the index and every
    chunk file again is W x (chunks + 1) opens an epoch. They take the parent's instead: here the chunk files are
    removed once the parent has opened the dataset, and opening a source fails in every process forked from then
    on, and two epochs of forked workers still read every file; spawned workers, which must open their own, meet
    the index damaged in place (the parent maps it: its own view is damaged too, so that comes last)."""
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(3)
    expected = {}
    for number in range(40):  # random bytes: stored as they are, about 4 KiB a file, several chunks
        expected[f"f{number:02d}"] = rng.integers(0, 256, 3000 + 97 * number, dtype=np.uint8).tobytes()
        (src / f"f{number:02d}").write_bytes(expected[f"f{number:02d}"])
    dest = tmp_path / "dest"
    pack(src, dest, PackOptions(codec="zstd:3", chunk_size=16 * 1024, workers=1))
    chunk_files = sorted((dest / "chunks").iterdir())
    assert len(chunk_files) > 3
    dataset = FileDataset(dest)
    assert len(dataset) == 40  # opened in this process: the index and (for the workers it forks) the chunk files
    paths = dataset.paths
    for chunk_file in chunk_files:
        chunk_file.unlink()

    def opened_again(source):
        raise AssertionError(f"a forked worker opened {source} again")

    monkeypatch.setattr(reading, "open_source", opened_again)
    loader = DataLoader(dataset, batch_size=4, num_workers=2, collate_fn=list, multiprocessing_context="fork")
    for _ in range(2):
        assert [data for batch in loader for data in batch] == [expected[path] for path in paths]
    index_file = dest / INDEX_NAME
    info = index_file.stat()
    with open(index_file, "r+b") as damaged:
        damaged.write(b"\xff" * info.st_size)
    os.utime(index_file, ns=(info.st_atime_ns, info.st_mtime_ns))
    spawned = DataLoader(dataset, batch_size=4, num_workers=1, collate_fn=list, multiprocessing_context="spawn")
    with pytest.raises(Exception, match=INDEX_NAME):
        next(iter(spawned))


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_image_folder_matches_torchvision_classes_samples_and_labels(packed, context):
    src, dest = packed
    classes, samples = torchvision_samples(src / "train")
    dataset = ImageFolder(dest, "train")
    assert dataset.classes == classes == ["cat", "dog", "emu"]
    assert dataset.class_to_idx == {name: i for i, name in enumerate(classes)}
    assert dataset.samples == samples and dataset.targets == [label for _, label in samples]
    assert "train/emu/linked/x.png" in [path for path, _ in dataset.samples]
    loader = DataLoader(dataset, batch_size=3, num_workers=2, collate_fn=list, multiprocessing_context=context)
    items = [item for batch in loader for item in batch]
    from PIL import Image

    for (image, label), (path, expected_label) in zip(items, samples, strict=True):
        with Image.open(src / path) as original:
            assert image.tobytes() == original.convert("RGB").tobytes() and label == expected_label


def test_epoch_sampler_decodes_ahead_exactly_the_files_read_next(packed):
    src, dest = packed
    paths = [f"files/d{i % 3}/f{i:03d}.bin" for i in range(60)]
    dataset = FileDataset(dest, paths=paths)
    sampler = EpochSampler(RandomSampler(dataset, generator=torch.Generator().manual_seed(7)), dataset)
    loader = DataLoader(dataset, batch_size=6, sampler=sampler, num_workers=0, collate_fn=list)
    for epoch in range(2):
        before = dataset.prefetch_stats()
        got = [data for batch in loader for data in batch]
        stats = dataset.prefetch_stats()
        assert sorted(got) == sorted((src / path).read_bytes() for path in paths)
        ahead, used, missed = (stats[k] - before[k] for k in ("ahead", "used", "missed"))
        # Only the first batch of an epoch is read before the plan says what comes; every other file was decoded
        # ahead, and every file decoded ahead was read.
        assert (ahead, used, missed) == (54, 54, 6), stats
        assert stats["held_bytes"] == 0, stats  # nothing decoded ahead is left over at the epoch's end


def test_without_the_sampler_every_file_is_read_when_asked(packed):
    src, dest = packed
    dataset = FileDataset(dest, paths=["files/d0/f000.bin", "files/d1/f001.bin"])
    assert [dataset[0], dataset[1]] == [(src / "files/d0/f000.bin").read_bytes(),
                                        (src / "files/d1/f001.bin").read_bytes()]
    assert dataset.prefetch_stats()["ahead"] == 0


def test_a_few_training_steps_under_mpiexec_fanstore_serve(packed, tmp_path):
    from test_serve import _REASON, MPIEXEC

    if _REASON is not None:
        pytest.skip(f"needs FUSE and MPI: {_REASON}")
    src, dest = packed
    for rank in range(2):
        (tmp_path / f"mp{rank}").mkdir()
    job = Path(__file__).with_name("serve_torch_job.py")
    done = subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, "-m", "fanstore", "serve", str(dest),
                           str(tmp_path / "mp{rank}"), "--local-dir", str(tmp_path / "local{rank}"), "--quiet",
                           "--", sys.executable, str(job), str(src), str(dest)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout + done.stderr
    results = {line["rank"]: line for line in map(json.loads, done.stdout.splitlines())}
    assert set(results) == {0, 1}
    for rank, result in results.items():
        assert result["bad"] == 0 and result["read"] == result["expected"] > 0, result
        # Every process of the node, DataLoader workers too, loaded the index from the rank's local directory, a
        # copy of DEST's byte for byte, and none opened DEST's during the epochs.
        local_index = tmp_path / f"local{rank}" / INDEX_NAME
        assert result["index_paths"] == [str(local_index)], result
        assert local_index.read_bytes() == (dest / INDEX_NAME).read_bytes()
        assert result["dest_index_opened"] is False, result
        assert result["refused"] == "refused" and result["steps"] == 3 and np.isfinite(result["loss"]), result
        assert result["remote_ahead"] > 0, result  # the node fetched remote blobs ahead of the workers
        # The workers read them where they landed, the node's arena, none copied through the socket.
        assert result["lent"] > 0 and result["not_lent"] == 0, result
        # The blobs of this rank's own chunks the workers read themselves, told to the node at their ends (--stats).
        assert result["readers_local"] > 0, result
        assert result["bogus_plan"] == "taken", result
        assert result["bad_plan"].startswith("plan row 1: chunk -1: the dataset's chunks are 0 to "), result
    # The plan's rows that are not blobs were dropped: none reached a peer, and none broke the node's fetches ahead.
    assert "request refused" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_two_training_processes_on_a_rank_each_have_their_plan_fetched_ahead(packed, tmp_path):
    """One training process per GPU: two on each rank of `mpiexec -n 2 fanstore serve`, each with its own
    DataLoader and DistributedSampler share, announcing its own order. The node keeps a plan for each (a node that
    kept one would have fetched ahead for the last to announce alone): both processes' reads find remote blobs
    fetched ahead, and every file is the source's, byte for byte."""
    from test_serve import _REASON, MPIEXEC

    if _REASON is not None:
        pytest.skip(f"needs FUSE and MPI: {_REASON}")
    src, dest = packed
    for rank in range(2):
        (tmp_path / f"mp{rank}").mkdir()
    job = Path(__file__).with_name("serve_torch_processes.py")
    done = subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, "-m", "fanstore", "serve", str(dest),
                           str(tmp_path / "mp{rank}"), "--local-dir", str(tmp_path / "local{rank}"), "--quiet",
                           "--", sys.executable, str(job), str(src), str(dest)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout + done.stderr
    results = {line["rank"]: line for line in map(json.loads, done.stdout.splitlines())}
    assert set(results) == {0, 1}, done.stdout
    for result in results.values():
        assert result["exit_codes"] == [0, 0], result
        trainers = result["trainers"]
        assert [trainer["number"] for trainer in trainers] == [0, 1], result
        for trainer in trainers:
            assert trainer["bad"] == 0 and trainer["read"] == trainer["expected"] == 15, trainer
            assert trainer["plans"] == 2, trainer  # both processes' plans held at once
            assert trainer["plan"]["rows"] > 0 and trainer["plan"]["hits"] > 0, trainer
        assert result["node"]["ahead_hits"] == sum(trainer["plan"]["hits"] for trainer in trainers), result
        assert result["node"]["plans"] == {}, result  # each given back when its process's connections closed
    assert "Traceback" not in done.stderr, done.stderr


def test_an_empty_class_is_refused_unless_allowed(tmp_path):
    src = tmp_path / "src"
    (src / "val" / "empty").mkdir(parents=True)
    (src / "val" / "full").mkdir()
    (src / "val" / "full" / "a.png").write_bytes(b"not decoded by listing")
    pack(src, tmp_path / "dest", PackOptions(codec="none", workers=1))
    with pytest.raises(FileNotFoundError, match="'empty'"):
        ImageFolder(tmp_path / "dest", "val")
    with ImageFolder(tmp_path / "dest", "val", allow_empty=True) as dataset:
        assert dataset.classes == ["empty", "full"] and dataset.samples == [("val/full/a.png", 1)]
        assert len(dataset) == 1
    assert "_process_reading" not in vars(dataset)


class CountersProbe(FileDataset):
    """Each item is (worker id, that worker's prefetch counters once the item's batch was read)."""

    def _item(self, data: bytes, item: int):
        from torch.utils.data import get_worker_info

        return get_worker_info().id, {k: v for k, v in self.prefetch_stats().items() if k != "held_bytes"}


@pytest.mark.parametrize("context", ["fork", "forkserver"])
def test_each_worker_decodes_ahead_exactly_its_own_next_batches(packed, context):
    """DataLoader hands batch k to worker k mod 2: each worker decodes its own next batches from the published
    plan, and reads every one of them; only its first batch of the epoch was not known ahead."""
    _, dest = packed
    paths = [f"files/d{i % 3}/f{i:03d}.bin" for i in range(60)]
    dataset = CountersProbe(dest, paths=paths)
    sampler = EpochSampler(RandomSampler(dataset, generator=torch.Generator().manual_seed(2)), dataset)
    loader = DataLoader(dataset, batch_size=5, sampler=sampler, num_workers=2, collate_fn=list,
                        multiprocessing_context=context)
    last = {worker: counters for batch in loader for worker, counters in batch}
    assert last == {w: {"ahead": 25, "used": 25, "waited": last[w]["waited"], "missed": 5, "out_of_turn": 0}
                    for w in (0, 1)}, last


class UnevenWorkers(CountersProbe):
    """CountersProbe whose items take 0 to 6 ms each at random, three times that in worker 0: the loader's batches
    go to whichever worker is free first."""

    def _item(self, data: bytes, item: int):
        from torch.utils.data import get_worker_info

        time.sleep(random.random() * (0.018 if get_worker_info().id == 0 else 0.006))
        return super()._item(data, item)


def test_workers_given_batches_out_of_turn_stop_decoding_ahead_what_others_read(packed):
    """DataLoader(in_order=False) hands each batch to a free worker, not in turn: each worker decoded ahead the
    batches its turn would have brought, many of which went to the other (on 12,000 files of 128 KiB: 38,000
    decoded ahead for 24,000 read, 60% more decoding, and slower). A worker whose batches come out of turn more
    often than in it decodes each as it comes; every item still arrives whole."""
    _, dest = packed
    paths = [f"files/d{i % 3}/f{i:03d}.bin" for i in range(60)] * 4
    dataset = UnevenWorkers(dest, paths=paths)
    sampler = EpochSampler(RandomSampler(dataset, generator=torch.Generator().manual_seed(2)), dataset)
    loader = DataLoader(dataset, batch_size=5, sampler=sampler, num_workers=2, collate_fn=list, in_order=False)
    batches = list(loader)
    assert sorted(len(batch) for batch in batches) == [5] * 48
    last = {worker: counters for batch in batches for worker, counters in batch}
    assert sum(counters["out_of_turn"] for counters in last.values()) >= 10, last
    wasted = sum(counters["ahead"] - counters["used"] for counters in last.values())
    assert wasted <= 2 * 6 * 5, last  # a few batches a worker before its turns are seen not to hold


def test_no_dataset_outside_serve_is_one_clear_error(monkeypatch):
    from fanstore.errors import UsageError

    monkeypatch.delenv("FANSTORE_SERVE_SOCKET", raising=False)
    with pytest.raises(UsageError, match="FANSTORE_SERVE_SOCKET"):
        len(FileDataset(None))


def test_a_reader_whose_serve_process_is_gone_reads_remote_files_from_dest(packed, tmp_path):
    """The socket leads nowhere (the node's serve process died): files stored here still come from the local
    directory, the others from DEST, logged once, never a failed read."""
    from fanstore import open_dataset
    from fanstore.core.chunk_source import LocalChunkSource
    from fanstore.serve.node_client import NodeChunkSource, NodeConnection
    from fanstore.serve.placement import place
    from fanstore.serve.staged_source import StagedChunkSource

    src, dest = packed
    with open_dataset(dest) as plain:
        index = plain.index
    sizes = index.chunks["size"]
    placement = place(index, 2).owners  # what a reader gets from its serve process
    dest_source = LocalChunkSource(dest, sizes)
    source = NodeChunkSource(NodeConnection(str(tmp_path / "gone.sock")), 0, placement,
                             StagedChunkSource(LocalChunkSource(dest, sizes), dest_source, 0), dest_source,
                             frozenset())
    paths = [f"files/d{i % 3}/f{i:03d}.bin" for i in range(60)]
    with open_dataset(dest, source=source) as dataset:
        assert [dataset.read(path) for path in paths] == [(src / path).read_bytes() for path in paths]
    remote = sum(1 for path in paths if not placement.is_local(0, int(index.entries["chunk"][index.lookup(path)]),
                                                                 int(index.entries["offset"][index.lookup(path)])))
    assert source.fallbacks == remote > 0


# A training process: a persistent 2-worker loader mid-epoch, its workers fed by the EpochSampler's plan. It prints
# its pid, its workers' and how many files they decoded ahead, then waits for a line: "os._exit" ends it so.
_TRAINER = """
import os, sys, time
from torch.utils.data import DataLoader, RandomSampler
from fanstore.torch import EpochSampler, FileDataset

class Ahead(FileDataset):
    def _item(self, data, item):
        return self.prefetch_stats()["ahead"]

dataset = Ahead(sys.argv[1])
loader = DataLoader(dataset, batch_size=2, sampler=EpochSampler(RandomSampler(dataset), dataset), num_workers=2,
                    collate_fn=list, persistent_workers=True)
batches = iter(loader)
ahead = max(max(next(batches)) for _ in range(6))
print(os.getpid(), *(worker.pid for worker in batches._workers), ahead, flush=True)
if sys.stdin.readline().strip() == "os._exit":
    os._exit(0)
time.sleep(60)
"""


def _names_held(pids: list[int], outside: Path) -> set[str]:
    """Paths in /dev/shm or the temporary directory that the processes have open or mapped: `outside`, the checkout
    and the Python environment aside (a clean clone in /tmp maps its virtual environment's libraries from there)."""
    places = ("/dev/shm/", tempfile.gettempdir().rstrip("/") + "/")
    held = set()
    for pid in pids:
        for link in Path(f"/proc/{pid}/fd").iterdir():
            try:
                held.add(os.readlink(link))
            except OSError:
                pass
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6:
                held.add(fields[5])
    ours = (outside, REPO, Path(sys.prefix), Path(sys.base_prefix))
    return {path for path in held if path.startswith(places) and not path.endswith(" (deleted)")
            and not any(Path(path).is_relative_to(place) for place in ours)}


@pytest.mark.parametrize("end", ["SIGKILL", "SIGTERM", "os._exit"])
def test_a_training_process_ended_any_way_leaves_no_epoch_plan_behind(packed, tmp_path, end):
    """The epoch plan lived in /dev/shm/fanstore-plan-PID-*.npy, removed by an exit handler: a training process
    killed (SIGKILL, or SIGTERM, which runs no handler) or leaving by os._exit left it until the next plan made on
    the machine. Nothing the plan uses has a name now: once the process and its workers are gone, so is it."""
    trainer = subprocess.Popen([sys.executable, "-c", _TRAINER, str(packed[1])], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, start_new_session=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        main, *workers, ahead = (int(number) for number in trainer.stdout.readline().split())
        assert int(ahead) > 0, "the workers never saw the plan"
        held = _names_held([main, *workers], packed[1])
        if end == "os._exit":
            trainer.stdin.write("os._exit\n")
            trainer.stdin.flush()
            trainer.wait(timeout=30)
        os.killpg(trainer.pid, getattr(signal, end, signal.SIGKILL))  # the workers too, as a launcher does
        trainer.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait()
    named = held | {str(path) for folder in {Path("/dev/shm"), Path(tempfile.gettempdir())}
                    for path in folder.glob(f"fanstore-plan-{main}-*")}  # what an exit handler would have removed
    assert sorted(path for path in named if Path(path).exists()) == []


def test_two_samplers_over_one_dataset_publish_from_two_threads_without_failing_and_are_warned_of(packed):
    """A training loader and an evaluation loader over one dataset object, iterated from two threads: their
    publications shared one temporary file name per process, and one thread's rename took the other's file away
    (FileNotFoundError from EpochSampler.__iter__). Each publication now has its own; and since the two orders
    take turns in the one plan, the second sampler is warned of it."""
    dataset = FileDataset(packed[1])
    first = EpochSampler(RandomSampler(dataset), dataset)
    with pytest.warns(UserWarning, match="this dataset already has an EpochSampler"):
        second = EpochSampler(RandomSampler(dataset), dataset)
    failures: list[BaseException] = []

    def publish(sampler: EpochSampler) -> None:
        try:
            for _ in range(300):
                list(iter(sampler))
        except BaseException as exc:  # noqa: BLE001 - the test reports whatever a thread met
            failures.append(exc)

    threads = [threading.Thread(target=publish, args=(sampler,)) for sampler in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    serial, order, _ = first.plan.current()
    assert serial > 0 and sorted(order.tolist()) == list(range(len(dataset)))


@pytest.mark.parametrize("context", ["spawn", "fork"])
def test_a_workers_private_memory_grows_by_at_most_24_bytes_a_file(tmp_path, context):
    """Issue 35's target, bounded not timed: a DataLoader worker (FileDataset over every file, an EpochSampler's
    order) maps the index and the epoch's order that its node shares, so what it holds alone grows by at most 24
    bytes a file (a spawned worker held 184 B a file more: the index read, the paths sorted, int64 arrays)."""
    sys.path.insert(0, str(REPO / "bench"))
    from bench_index import worker_private_memory
    from synthetic_index import make_dataset

    small, large = 20_000, 320_000
    private = {files: worker_private_memory(str(make_dataset(tmp_path / str(files), files)), context)
               for files in (small, large)}
    per_file = (private[large] - private[small]) / (large - small)
    assert per_file <= 24, f"{per_file:.1f} B a file: {private}"
