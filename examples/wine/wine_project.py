"""A user's project for rtp: a model and a dataset of its own, registered by name (`plugins=[wine_project]`)."""
from dataclasses import dataclass
from pathlib import Path

from contract.registry import DatasetSpec, ModelSpec, register_dataset, register_model
from pipelines.data.table import prepare_table

HERE = Path(__file__).resolve().parent


@dataclass
class WineNetConfig:
    name: str = "wine_net"  # one hidden layer, for small tables
    hidden: int = 32        # its width
    dropout: float = 0.1    # after it


def build_torch(cfg, inputs, seed):
    from torch import nn

    return nn.Sequential(nn.Linear(inputs.features.width, cfg.hidden), nn.ReLU(), nn.Dropout(cfg.dropout),
                         nn.Linear(cfg.hidden, inputs.target.outputs))


def build_keras(keras, cfg, inputs, seed):
    return keras.Sequential([keras.Input((inputs.features.width,)), keras.layers.Dense(cfg.hidden, "relu"),
                             keras.layers.Dropout(cfg.dropout), keras.layers.Dense(inputs.target.outputs)])


def prepare_wine(args):
    columns = (HERE / "wine.csv").read_text().splitlines()[0].split(",")
    return prepare_table(source=[HERE / "wine.csv"], features=columns[:-1], label="cultivar", out=args.out,
                         name="wine", val_fraction=0.2, test_fraction=0.2)


register_model(ModelSpec("wine_net", WineNetConfig, "one hidden layer, for tables", inputs=("numeric",),
                         torch=build_torch, keras=build_keras))
register_dataset(DatasetSpec("wine", prepare_wine, lambda parser: parser.add_argument("--out", type=Path,
                             default=Path("data/wine")), "178 Italian wines, 3 cultivars", "data/wine"))
