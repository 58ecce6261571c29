"""The demo's PyTorch run (fanstore/demo/demo_torch.py): each reader lists the same images as ImageFolder, and the same
seed gives the same model whichever reader fed it, without changing torch's settings for the caller."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/setup installs torch==2.13.0+cpu)")

from fanstore import PackOptions, open_dataset, pack  # noqa: E402
from fanstore.demo.demo_data import build_demo_tree  # noqa: E402
from fanstore.demo.demo_torch import (  # noqa: E402
    TrainingSettings, directory_reading, list_samples, packed_reading, train)
from fanstore.torch import ImageFolder  # noqa: E402
from fanstore.torch.datasets import make_samples  # noqa: E402

ONE_EPOCH = TrainingSettings(epochs=1)


@pytest.fixture(scope="module")
def packed_demo(tmp_path_factory):
    """The demo tree and its packed dataset, as `fanstore demo` makes them."""
    top = tmp_path_factory.mktemp("demo")
    source, dataset = top / "source", top / "dataset"
    build_demo_tree(source)
    pack(source, dataset, PackOptions(codec="zstd:3", force=True))
    return source, dataset


def test_the_plain_listing_is_image_folders(packed_demo):
    source, dataset = packed_demo
    classes, train_samples = list_samples(source, "train")
    _, val_samples = list_samples(source, "val", classes)
    packed = ImageFolder(dataset, root="train")
    assert (classes, train_samples) == (packed.classes, packed.samples)
    with open_dataset(dataset) as opened:
        assert val_samples == make_samples(opened, "val", packed.class_to_idx)
    assert "empty_class" not in {path.split("/")[1] for path, _ in val_samples}  # the training classes only
    assert classes[-1] == "photos" and len(classes) == 11


def test_every_reader_trains_the_same_model_and_torch_settings_come_back(packed_demo):
    source, dataset = packed_demo
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    random_state = torch.get_rng_state()
    results = [train(directory_reading("original", source, ONE_EPOCH), ONE_EPOCH),
               train(packed_reading("packed", dataset, ONE_EPOCH), ONE_EPOCH)]
    assert results[0].accuracy == results[1].accuracy > 0.5, results
    assert results[0].weights_digest == results[1].weights_digest, results
    assert all(len(result.epoch_seconds) == len(result.wait_seconds) == 1 for result in results)
    assert all(0 <= result.wait_seconds[0] <= result.epoch_seconds[0] for result in results)
    assert (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()) == (threads, deterministic)
    assert torch.equal(torch.get_rng_state(), random_state)
