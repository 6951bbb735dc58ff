"""Image data for the VGG recipe: CIFAR-10 from its Python files, or a generated 10-class set.

``load_cifar10`` reads the ``cifar-10-batches-py`` folder of CIFAR-10's Python version with an unpickler that
only builds numpy arrays, so a tampered file cannot run code. ``generated_images`` makes a learnable
CIFAR-shaped set on any machine without a download, for smoke runs and tests.

``ImageSet`` augments with the standard CIFAR recipe (4-pixel padded random crop, horizontal flip), seeded
from (seed, epoch, sample index) alone: a run split over data-parallel ranks or loader workers augments each
sample exactly as one process would, so parallel runs can be compared to a single-process reference.
``EpochTaggedSampler`` hands it the epoch by yielding ``(epoch, index)`` pairs.
"""

from __future__ import annotations

import importlib
import pickle
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset, DistributedSampler

# Per-channel mean and standard deviation of the CIFAR-10 training pixels, in 0..1 units. (The often-copied
# std (0.2023, 0.1994, 0.2010) is a mean of per-image stds, not the pixel std.)
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)

CIFAR10_FOLDER = "cifar-10-batches-py"
_SPLIT_FILES = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
_DAMAGED_FIX = "extract cifar-10-python.tar.gz again (the file is damaged or cut short)"
_ROW_BYTES = 3 * 32 * 32  # channel-major: the R plane, then G, then B, each 32 x 32 row-major

# The only globals a pickled ndarray needs, under numpy 1 (numpy.core) and numpy 2 (numpy._core) names:
# _reconstruct for protocols <= 4 (the original Python 2 files), _frombuffer for protocol 5 re-saves.
_ALLOWED_GLOBALS = {
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    *((f"numpy.{core}.multiarray", name) for core in ("core", "_core") for name in ("_reconstruct", "scalar")),
    *((f"numpy.{core}.numeric", "_frombuffer") for core in ("core", "_core")),
}


class RefusedPickleError(pickle.UnpicklingError):
    """A batch file names a global that a CIFAR-10 batch never needs: refused, not run."""


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays; any other global (``os.system``, ...) is refused."""

    def __init__(self, file: Any, source: Path) -> None:
        super().__init__(file, encoding="bytes")  # the CIFAR files were written by Python 2
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise RefusedPickleError(
                f"{self.source} refers to {module}.{name}, which a CIFAR-10 batch never does: refusing to "
                "unpickle it (it could run code). Re-download CIFAR-10's python version from a trusted source."
            )
        if module.startswith("numpy.core."):  # numpy 2 keeps the old names only as deprecated aliases
            module = "numpy._core." + module.removeprefix("numpy.core.")
        try:
            return getattr(importlib.import_module(module), name)
        except ImportError:  # numpy 1 has no numpy._core
            return getattr(importlib.import_module(module.replace("numpy._core.", "numpy.core.")), name)


def _read_batch(file: Path) -> tuple[np.ndarray, np.ndarray]:
    """One batch file as (uint8 rows of 3072 bytes, int64 labels), with its shape and labels checked."""
    with file.open("rb") as f:
        try:
            batch = _NumpyOnlyUnpickler(f, file).load()
        except RefusedPickleError:
            raise
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError) as err:  # cut short, or garbage
            raise ValueError(f"{file} is not a readable CIFAR-10 batch ({err!r}): {_DAMAGED_FIX}") from None
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise ValueError(f"{file} is not a CIFAR-10 batch (a dict with b'data' and b'labels').")
    data, labels = np.asarray(batch[b"data"]), np.asarray(batch[b"labels"])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != _ROW_BYTES:
        raise ValueError(f"{file}: data is {data.dtype} {data.shape}, expected uint8 (N, {_ROW_BYTES}).")
    if labels.shape != (len(data),) or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{file}: {labels.shape} labels of type {labels.dtype} for {len(data)} images.")
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        raise ValueError(f"{file}: labels span {labels.min()}..{labels.max()}, CIFAR-10 has 0..9.")
    return data, labels.astype(np.int64)


def load_cifar10(folder: str | Path, split: str) -> tuple[Tensor, Tensor]:
    """CIFAR-10 from the ``cifar-10-batches-py`` folder of its Python version.

    Args:
        folder: the ``cifar-10-batches-py`` folder, or the folder that holds it (the ``data.path`` setting).
        split: ``"train"`` (``data_batch_1`` to ``data_batch_5``) or ``"test"`` (``test_batch``).

    Returns:
        Images, uint8 ``(N, 3, 32, 32)``, and labels, int64 ``(N,)`` in 0..9.
    """
    if split not in _SPLIT_FILES:
        raise ValueError(f"split={split!r} is unknown for CIFAR-10: use 'train' or 'test'.")
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(
            f"data.path={str(folder)!r} is not a folder: point it at the {CIFAR10_FOLDER} folder of "
            "CIFAR-10's python version (https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz, extracted)."
        )
    if (root / CIFAR10_FOLDER).is_dir():
        root = root / CIFAR10_FOLDER
    datas, labels = [], []
    for name in _SPLIT_FILES[split]:
        file = root / name
        if not file.is_file():
            raise FileNotFoundError(
                f"data.path={str(folder)!r} has no {name}: point it at the {CIFAR10_FOLDER} folder of "
                "CIFAR-10's python version (or the folder that holds it)."
            )
        data, label = _read_batch(file)
        datas.append(data)
        labels.append(label)
    images = np.concatenate(datas).reshape(-1, 3, 32, 32)  # (N, C, H, W): the rows are channel-major
    return torch.from_numpy(images), torch.from_numpy(np.concatenate(labels))


# The class prototypes come from this fixed seed, not the caller's, so every (num, seed) set, train or val,
# shows the same classes; `seed` only picks the samples.
_CLASS_SEED = 20_240_910
# How hard the set is. Tuned so that a 3-layer conv net (SGD, batch 64) takes the loss from 2.3 to about 0.5 in
# 200 steps and reaches about 85% on a fresh set, while a nearest-class-mean rule gets about 75%: learnable,
# yet the classes are not told apart by fixed pixels.
_MAX_SHIFT = 6  # pixels a sample's pattern moves each way
_NOISE = 0.15  # std of the per-pixel Gaussian noise, 0..1 units
_CLUTTER_WAVE = 0.15  # std of the per-channel amplitude of each sample's own distractor wave
_CLUTTER_BLOB = 0.4  # largest per-channel amplitude of each sample's own distractor blob
_CHUNK = 2048  # images generated at once: keeps each float32 temporary at 25 MB for 32 x 32 images


def _prototypes(num_classes: int, size: int) -> np.ndarray:
    """(num_classes, 3, size + 2 * shift, size + 2 * shift) float32 smooth color patterns in about 0..1."""
    rng = np.random.default_rng([_CLASS_SEED, num_classes, size])
    canvas = size + 2 * _MAX_SHIFT
    coords = (np.arange(canvas, dtype=np.float32) - _MAX_SHIFT) / size  # image plane is 0..1
    yy, xx = coords[:, None], coords[None, :]
    protos = np.zeros((num_classes, 3, canvas, canvas), np.float32)
    for c in range(num_classes):
        # Low-frequency waves (at most 2 cycles per image) give every class a texture of its own...
        for _ in range(3):
            fy, fx = rng.uniform(-2.0, 2.0, 2)
            wave = np.cos(2 * np.pi * (fy * yy + fx * xx) + rng.uniform(0, 2 * np.pi))
            protos[c] += rng.normal(0, 0.12, (3, 1, 1)).astype(np.float32) * wave
        # ...and a few colored blobs give it shapes and colors, the cues a CIFAR net keys on.
        for _ in range(3):
            cy, cx = rng.uniform(0.15, 0.85, 2)
            radius = rng.uniform(0.12, 0.3)
            blob = np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * radius**2))
            protos[c] += rng.uniform(-0.35, 0.35, (3, 1, 1)).astype(np.float32) * blob
    return protos + 0.5


def _clutter(rng: np.random.Generator, n: int, size: int) -> np.ndarray:
    """(n, 3, size, size) float32 per-sample distractors: a smooth color wave and a colored blob."""
    coords = np.arange(size, dtype=np.float32) / size
    freq = rng.uniform(-2.0, 2.0, (n, 2, 1, 1)).astype(np.float32)
    phase = rng.uniform(0, 2 * np.pi, (n, 1, 1, 1)).astype(np.float32)
    wave = np.cos(2 * np.pi * (freq[:, 0:1] * coords[:, None] + freq[:, 1:2] * coords) + phase)  # (n, 1, H, W)
    x = rng.normal(0, _CLUTTER_WAVE, (n, 3, 1, 1)).astype(np.float32) * wave
    center = rng.uniform(0.1, 0.9, (n, 2, 1)).astype(np.float32)
    radius = rng.uniform(0.1, 0.25, (n, 1)).astype(np.float32)
    gy, gx = np.exp(-((coords - center) ** 2) / (2 * radius[:, None] ** 2)).transpose(1, 0, 2)  # (n, H) each
    color = rng.uniform(-_CLUTTER_BLOB, _CLUTTER_BLOB, (n, 3, 1, 1)).astype(np.float32)
    return x + color * (gy[:, None, :, None] * gx[:, None, None, :])


def generated_images(num: int, seed: int, num_classes: int = 10, image_size: int = 32) -> tuple[Tensor, Tensor]:
    """A learnable CIFAR-shaped image set, generated without a download and the same on every machine.

    Each class is a fixed smooth color pattern (the same for every ``seed``); a sample is its class pattern
    moved by up to 6 pixels, with random contrast and brightness, a distractor wave and blob of its own and
    per-pixel noise, so a small conv net learns it within a few hundred steps but not perfectly.

    Args:
        num: number of images.
        seed: picks the samples; sets with different seeds share the classes (use one for train, one for val).
        num_classes: number of classes; labels are balanced (counts differ by at most one).
        image_size: height and width.

    Returns:
        Images, uint8 ``(num, 3, image_size, image_size)``, and labels, int64 ``(num,)``.
    """
    if num < 1 or num_classes < 2 or image_size < 1:
        raise ValueError(
            f"generated_images needs num >= 1, num_classes >= 2 and image_size >= 1, got num={num}, "
            f"num_classes={num_classes}, image_size={image_size}."
        )
    protos = _prototypes(num_classes, image_size)
    rng = np.random.default_rng([seed, num, num_classes, image_size])
    labels = rng.permutation(np.arange(num) % num_classes)
    shifts = rng.integers(0, 2 * _MAX_SHIFT + 1, (num, 2))
    contrast = rng.uniform(0.6, 1.4, (num, 1, 1, 1)).astype(np.float32)
    brightness = rng.uniform(-0.15, 0.15, (num, 1, 1, 1)).astype(np.float32)
    pix = np.arange(image_size)
    chan = np.arange(3)[None, :, None, None]
    images = np.empty((num, 3, image_size, image_size), np.uint8)
    for lo in range(0, num, _CHUNK):
        hi = min(lo + _CHUNK, num)
        rows = (shifts[lo:hi, 0, None] + pix)[:, None, :, None]  # (n, 1, H, 1)
        cols = (shifts[lo:hi, 1, None] + pix)[:, None, None, :]  # (n, 1, 1, W)
        x = protos[labels[lo:hi, None, None, None], chan, rows, cols]  # (n, 3, H, W) crops of the canvas
        x = (x - 0.5) * contrast[lo:hi] + 0.5 + brightness[lo:hi] + _clutter(rng, hi - lo, image_size)
        x += rng.standard_normal(x.shape, dtype=np.float32) * _NOISE
        images[lo:hi] = np.clip(x * 255 + 0.5, 0, 255).astype(np.uint8)
    return torch.from_numpy(images), torch.from_numpy(labels.astype(np.int64))


def _mix_seed(*values: int) -> int:
    """A well-mixed 64-bit seed from a few ints (splitmix64 steps): nearby indices get unrelated streams."""
    mask = (1 << 64) - 1
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = ((h ^ (v & mask)) * 0xBF58476D1CE4E5B9) & mask
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & mask
        h ^= h >> 31
    return h


class ImageSet(Dataset):
    """uint8 images and their labels, served as normalized float32 images, optionally augmented.

    An index is an int or an ``(epoch, index)`` pair (what ``EpochTaggedSampler`` yields). The augmentation
    of a sample depends only on ``(seed, epoch, index)``: not on the rank, worker or batch that loads it.
    An int index augments as epoch 0, so train with ``EpochTaggedSampler`` to get new crops every epoch.

    Args:
        images: uint8 ``(N, 3, H, W)``.
        labels: integer ``(N,)``.
        mean: per-channel mean in 0..1 units, subtracted after scaling pixels to 0..1.
        std: per-channel standard deviation in 0..1 units.
        augment: random crop with 4-pixel zero padding and random horizontal flip (for training).
        seed: seeds the augmentation, together with the epoch and the index.
    """

    pad = 4

    def __init__(
        self,
        images: Tensor,
        labels: Tensor,
        mean: Sequence[float] = CIFAR10_MEAN,
        std: Sequence[float] = CIFAR10_STD,
        augment: bool = False,
        seed: int = 0,
    ) -> None:
        if images.dtype != torch.uint8 or images.ndim != 4:
            raise ValueError(f"ImageSet takes uint8 (N, C, H, W) images, got {images.dtype} {tuple(images.shape)}.")
        if labels.shape != images.shape[:1]:
            raise ValueError(f"ImageSet got {tuple(labels.shape)} labels for {len(images)} images.")
        channels = images.shape[1]
        if len(mean) != channels or len(std) != channels or min(std) <= 0:
            raise ValueError(f"mean={tuple(mean)} and std={tuple(std)} need {channels} values each, std > 0.")
        self.images, self.labels = images, labels.long()
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)  # (C, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
        self.augment, self.seed = augment, seed

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[Tensor, Tensor]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        image = self.images[index]  # (C, H, W) uint8
        if self.augment:
            image = self._crop_and_flip(image, int(epoch), int(index))
        return (image.float() / 255 - self.mean) / self.std, self.labels[index]

    def _crop_and_flip(self, image: Tensor, epoch: int, index: int) -> Tensor:
        gen = torch.Generator().manual_seed(_mix_seed(self.seed, epoch, index))
        top, left = torch.randint(0, 2 * self.pad + 1, (2,), generator=gen).tolist()
        flip = bool(torch.randint(0, 2, (), generator=gen))
        h, w = image.shape[-2:]
        # Padding with 0 before normalizing pads with black, as torchvision's RandomCrop(padding=4) does.
        padded = F.pad(image, (self.pad,) * 4)
        image = padded[:, top : top + h, left : left + w]
        return image.flip(-1) if flip else image


class EpochTaggedSampler(DistributedSampler):
    """``DistributedSampler`` that yields ``(epoch, index)`` pairs, so ``ImageSet`` can seed by epoch.

    Same arguments and same indices as ``DistributedSampler``; the epoch is the one ``set_epoch`` set
    (Lightning calls it on the train sampler at the start of every epoch).
    """

    def __iter__(self) -> Iterator[tuple[int, int]]:  # type: ignore[override]
        epoch = self.epoch
        for index in super().__iter__():
            yield epoch, index
