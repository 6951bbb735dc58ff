"""Unit tests of the VGG recipe's image data: CIFAR-10 loading, the generated set, augmentation, the sampler.

No process group and no download: the CIFAR-10 files are tiny ones written here in the real format.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_parallel.recipes.image_data import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    EpochTaggedSampler,
    ImageSet,
    generated_images,
    load_cifar10,
)

PER_BATCH = 4


class _Python2Pickler(pickle._Pickler):
    """Writes bytes as Python 2 ``str`` opcodes, as the original CIFAR-10 files (protocol 2, Python 2) do."""

    dispatch = pickle._Pickler.dispatch.copy()

    def save_bytes(self, obj: bytes) -> None:
        n = len(obj)
        self.write(
            pickle.SHORT_BINSTRING + bytes([n]) + obj if n < 256 else pickle.BINSTRING + struct.pack("<i", n) + obj
        )
        self.memoize(obj)

    dispatch[bytes] = save_bytes


def _dump(obj: object, path: Path, style: str) -> None:
    if style == "py3":  # a re-save by modern Python and numpy: protocol 5, numpy._core.numeric._frombuffer
        path.write_bytes(pickle.dumps(obj, protocol=5))
        return
    buf = io.BytesIO()
    _Python2Pickler(buf, protocol=2).dump(obj)
    raw = buf.getvalue()
    # The originals were written by numpy 1, whose arrays pickle as numpy.core.multiarray._reconstruct.
    assert b"cnumpy._core.multiarray\n_reconstruct\n" in raw
    path.write_bytes(raw.replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n"))


def _write_cifar(parent: Path, style: str = "py2") -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A tiny cifar-10-batches-py folder: 5 train batches and a test batch of PER_BATCH images each."""
    folder = parent / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    expected: dict[str, list] = {"train": [], "test": []}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        images = rng.integers(0, 256, (PER_BATCH, 3, 32, 32), dtype=np.uint8)
        labels = rng.integers(0, 10, PER_BATCH).tolist()
        batch = {
            b"batch_label": f"{name} of 6".encode(),
            b"labels": labels,
            b"data": images.reshape(PER_BATCH, 3072),  # each row: R plane, G plane, B plane
            b"filenames": [f"img_{i}.png".encode() for i in range(PER_BATCH)],
        }
        _dump(batch, folder / name, style)
        expected["test" if name == "test_batch" else "train"].append((images, labels))
    return {k: (np.concatenate([i for i, _ in v]), np.concatenate([y for _, y in v])) for k, v in expected.items()}


@pytest.mark.parametrize("style", ["py2", "py3"])
def test_load_cifar10_exact_pixels_and_labels(tmp_path: Path, style: str) -> None:
    expected = _write_cifar(tmp_path, style)
    for split, n in (("train", 5 * PER_BATCH), ("test", PER_BATCH)):
        images, labels = load_cifar10(tmp_path / "cifar-10-batches-py", split)
        assert images.dtype == torch.uint8 and images.shape == (n, 3, 32, 32)
        assert labels.dtype == torch.int64 and labels.shape == (n,)
        assert torch.equal(images, torch.from_numpy(expected[split][0]))
        assert labels.tolist() == expected[split][1].tolist()
    # Channel-major rows: byte c * 1024 + y * 32 + x of a row is channel c at (y, x).
    raw = pickle.loads((tmp_path / "cifar-10-batches-py" / "data_batch_2").read_bytes(), encoding="bytes")[b"data"]
    images, _ = load_cifar10(tmp_path, "train")
    assert images[PER_BATCH + 1, 2, 5, 7] == raw[1, 2 * 1024 + 5 * 32 + 7]


def test_load_cifar10_accepts_parent_folder(tmp_path: Path) -> None:
    _write_cifar(tmp_path)
    a, la = load_cifar10(tmp_path, "train")
    b, lb = load_cifar10(str(tmp_path / "cifar-10-batches-py"), "train")
    assert torch.equal(a, b) and torch.equal(la, lb)


def test_load_cifar10_missing_data_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"data.path='.*nowhere' is not a folder: point it at"):
        load_cifar10(tmp_path / "nowhere", "train")
    with pytest.raises(FileNotFoundError, match=r"has no data_batch_1: point it at the cifar-10-batches-py folder"):
        load_cifar10(tmp_path, "train")
    _write_cifar(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match=r"data.path=.* has no data_batch_3"):
        load_cifar10(tmp_path, "train")
    load_cifar10(tmp_path, "test")  # the test split does not need the train files
    with pytest.raises(ValueError, match=r"split='val' is unknown for CIFAR-10: use 'train' or 'test'"):
        load_cifar10(tmp_path, "val")


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_load_cifar10_refuses_code_in_pickle(tmp_path: Path) -> None:
    _write_cifar(tmp_path)
    marker = tmp_path / "payload_ran"
    file = tmp_path / "cifar-10-batches-py" / "data_batch_1"
    file.write_bytes(pickle.dumps({b"data": _Payload(marker), b"labels": [0]}, protocol=4))
    with pytest.raises(pickle.UnpicklingError, match=r"data_batch_1 refers to (posix|nt|os)\.system.*refusing"):
        load_cifar10(tmp_path, "train")
    assert not marker.exists()
    file.write_bytes(pickle.dumps({b"data": eval}))  # any other global, a builtin included
    with pytest.raises(pickle.UnpicklingError, match=r"refers to builtins\.eval"):
        load_cifar10(tmp_path, "train")


def test_load_cifar10_checks_contents(tmp_path: Path) -> None:
    _write_cifar(tmp_path)
    file = tmp_path / "cifar-10-batches-py" / "test_batch"
    good = np.zeros((2, 3072), np.uint8)
    cases = [
        ({b"data": good, b"labels": [0, 10]}, r"labels span 0\.\.10, CIFAR-10 has 0\.\.9"),
        ({b"data": np.zeros((2, 3000), np.uint8), b"labels": [0, 1]}, r"expected uint8 \(N, 3072\)"),
        ({b"data": good.astype(np.float32), b"labels": [0, 1]}, r"data is float32"),
        ({b"data": good, b"labels": [0]}, r"\(1,\) labels .* for 2 images"),
        ({b"pixels": good}, r"is not a CIFAR-10 batch"),
    ]
    for batch, message in cases:
        file.write_bytes(pickle.dumps(batch))
        with pytest.raises(ValueError, match=message):
            load_cifar10(tmp_path, "test")


def test_generated_images_deterministic_balanced_uint8() -> None:
    images, labels = generated_images(1005, seed=3)
    assert images.dtype == torch.uint8 and images.shape == (1005, 3, 32, 32)
    assert labels.dtype == torch.int64 and labels.shape == (1005,)
    assert sorted(torch.bincount(labels, minlength=10).tolist()) == [100] * 5 + [101] * 5
    again, again_labels = generated_images(1005, seed=3)
    assert torch.equal(images, again) and torch.equal(labels, again_labels)
    other, _ = generated_images(1005, seed=4)
    assert not torch.equal(images, other)
    assert images.float().std() > 30  # a real spread of pixel values, not a flat image
    small, small_labels = generated_images(12, seed=0, num_classes=4, image_size=16)
    assert small.shape == (12, 3, 16, 16) and torch.bincount(small_labels).tolist() == [3, 3, 3, 3]
    with pytest.raises(ValueError, match="num >= 1"):
        generated_images(0, seed=0)


def test_generated_images_learnable_not_trivial() -> None:
    """A nearest-class-mean rule fit on one seed and scored on another: well above chance, short of perfect."""
    train, train_labels = generated_images(2000, seed=1)
    val, val_labels = generated_images(1000, seed=2)
    flat = lambda x: x.float().flatten(1) / 255
    means = torch.stack([flat(train)[train_labels == c].mean(0) for c in range(10)])  # (10, 3072)
    accuracy = (torch.cdist(flat(val), means).argmin(1) == val_labels).float().mean().item()
    assert 0.5 < accuracy < 0.95, f"nearest-class-mean accuracy {accuracy:.3f}; chance is 0.1"


def test_image_set_normalizes() -> None:
    images, labels = generated_images(8, seed=0)
    data = ImageSet(images, labels, CIFAR10_MEAN, CIFAR10_STD)
    x, y = data[5]
    assert x.dtype == torch.float32 and x.shape == (3, 32, 32) and y.dtype == torch.int64 and y == labels[5]
    mean, std = torch.tensor(CIFAR10_MEAN).view(3, 1, 1), torch.tensor(CIFAR10_STD).view(3, 1, 1)
    torch.testing.assert_close(x, (images[5].float() / 255 - mean) / std, atol=0, rtol=0)
    assert torch.equal(data[(7, 5)][0], x)  # without augmentation the epoch changes nothing
    with pytest.raises(ValueError, match="uint8"):
        ImageSet(images.float(), labels)
    with pytest.raises(ValueError, match=r"need 3 values each"):
        ImageSet(images, labels, mean=(0.5,), std=(0.2,))


def _crops_and_flips(image: torch.Tensor, pad: int = 4) -> list[torch.Tensor]:
    padded = torch.nn.functional.pad(image, (pad,) * 4)
    crops = [padded[:, t : t + 32, s : s + 32] for t in range(2 * pad + 1) for s in range(2 * pad + 1)]
    return crops + [c.flip(-1) for c in crops]


def test_augmentation_depends_only_on_seed_epoch_index() -> None:
    images, labels = generated_images(16, seed=0)
    mean, std = (0.0, 0.0, 0.0), (1 / 255, 1 / 255, 1 / 255)  # identity scaling: outputs are the pixels
    a = ImageSet(images, labels, mean, std, augment=True, seed=7)
    b = ImageSet(images.clone(), labels, mean, std, augment=True, seed=7)
    for key in [(0, 3), (1, 3), (5, 11)]:
        assert torch.equal(a[key][0], b[key][0])
    assert torch.equal(a[3][0], a[(0, 3)][0])  # an int index is epoch 0
    # Each output is one of the 162 padded crops and flips of its image...
    for epoch in range(4):
        out = a[(epoch, 3)][0].round().to(torch.uint8)
        assert any(torch.equal(out, c) for c in _crops_and_flips(images[3]))
    # ...and a new one in most epochs, for most samples, and under another seed.
    by_epoch = {tuple(a[(e, 3)][0].flatten()[:2000].tolist()) for e in range(8)}
    assert len(by_epoch) >= 4
    assert sum(not torch.equal(a[(0, i)][0], a[(1, i)][0]) for i in range(16)) >= 12
    c = ImageSet(images, labels, mean, std, augment=True, seed=8)
    assert sum(not torch.equal(a[(0, i)][0], c[(0, i)][0]) for i in range(16)) >= 12


@pytest.mark.parametrize("shuffle, n", [(True, 20), (False, 20), (True, 21)])
def test_epoch_tagged_sampler_matches_distributed_sampler(shuffle: bool, n: int) -> None:
    data = list(range(n))
    tagged, plain = [], []
    for rank in range(2):
        sampler = EpochTaggedSampler(data, num_replicas=2, rank=rank, shuffle=shuffle, seed=5)
        reference = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=shuffle, seed=5)
        sampler.set_epoch(3)
        reference.set_epoch(3)
        pairs = list(sampler)
        assert len(pairs) == len(sampler) and {e for e, _ in pairs} == {3}
        assert [i for _, i in pairs] == list(reference)
        tagged += [i for _, i in pairs]
        plain += list(reference)
    single = EpochTaggedSampler(data, num_replicas=1, rank=0, shuffle=shuffle, seed=5)
    single.set_epoch(3)
    assert set(tagged) == {i for _, i in single} == set(range(n))


def test_two_ranks_augment_like_one_process() -> None:
    """The batches two data-parallel ranks load hold exactly the tensors one process loads for those samples."""
    images, labels = generated_images(24, seed=0)
    data = ImageSet(images, labels, augment=True, seed=1)

    def loaded(num_replicas: int, rank: int, workers: int = 0) -> dict[int, torch.Tensor]:
        sampler = EpochTaggedSampler(data, num_replicas=num_replicas, rank=rank, shuffle=True, seed=2)
        sampler.set_epoch(2)
        order = [i for _, i in sampler]
        batches = list(DataLoader(data, batch_size=5, sampler=sampler, num_workers=workers))
        xs, ys = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
        assert torch.equal(ys, labels[order])
        return dict(zip(order, xs))

    single = loaded(1, 0)
    split = {**loaded(2, 0), **loaded(2, 1, workers=2)}
    assert split.keys() == single.keys()
    for i in single:
        assert torch.equal(split[i], single[i]), f"sample {i} augmented differently across the layouts"
