"""A user's image project for rtp: pictures it draws itself and a small CNN of its own (`plugins=[shapes_project]`)."""
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from contract.registry import DatasetSpec, ModelSpec, register_dataset, register_model
from pipelines.data.table import prepare_table

HERE = Path(__file__).resolve().parent
SHAPES, SIZE = ("box", "cross", "disc"), 16  # three classes of 16x16 grayscale pictures


@dataclass
class ShapeNetConfig:
    name: str = "shape_net"  # two convolutions and a linear head, for small grayscale images
    channels: int = 8        # of the first convolution; the second has twice as many


def build_torch(cfg, inputs, seed):
    from torch import nn

    c = cfg.channels
    return nn.Sequential(nn.Unflatten(1, (1, *inputs.features.shape)),  # rows come flat: [B, H * W]
                         nn.Conv2d(1, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.AdaptiveMaxPool2d(1), nn.Flatten(),
                         nn.Linear(2 * c, inputs.target.outputs))


def draw(shape, rng):
    """One shape, white on a noisy black background, of a random size and place."""
    half = int(rng.integers(3, 6))
    cy, cx = rng.integers(half, SIZE - half, 2)
    dy, dx = np.abs(np.arange(SIZE)[:, None] - cy), np.abs(np.arange(SIZE)[None, :] - cx)
    mask = {"box": np.maximum(dy, dx) == half, "disc": dy ** 2 + dx ** 2 <= half ** 2,
            "cross": ((dy == 0) & (dx <= half)) | ((dx == 0) & (dy <= half))}[shape]
    return np.maximum(mask * 255, rng.integers(0, 80, (SIZE, SIZE))).astype(np.uint8)


def prepare_shapes(args):
    """Draws `--per-shape` PNG files of each shape into images/<shape>/, lists them in images/index.csv, and
    prepares that table: its `file` column holds image paths, its `shape` column the label."""
    from PIL import Image

    rng, rows = np.random.default_rng(0), ["file,shape"]
    for shape in SHAPES:
        (HERE / "images" / shape).mkdir(parents=True, exist_ok=True)
        for i in range(args.per_shape):
            Image.fromarray(draw(shape, rng)).save(HERE / "images" / shape / f"{i:03d}.png")
            rows.append(f"{shape}/{i:03d}.png,{shape}")
    (HERE / "images" / "index.csv").write_text("\n".join(rows) + "\n")
    return prepare_table(source=[HERE / "images" / "index.csv"], image="file", image_shape=(SIZE, SIZE),
                         label="shape", out=args.out, name="shapes", val_fraction=0.2, test_fraction=0.2)


def shapes_arguments(parser):
    parser.add_argument("--out", type=Path, default=Path("data/shapes"))
    parser.add_argument("--per-shape", type=int, default=100, help="pictures drawn of each shape")


register_model(ModelSpec("shape_net", ShapeNetConfig, "a small CNN for grayscale pictures", inputs=("image",),
                         torch=build_torch))
register_dataset(DatasetSpec("shapes", prepare_shapes, shapes_arguments, "boxes, crosses and discs, drawn",
                             "data/shapes"))
