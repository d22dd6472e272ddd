"""`TorchBackend`: what every PyTorch backend shares on Ray Train (ddp, fsdp, tp, deepspeed, lightning, horovod
torch). Its workers set torch's threads and device, read their data as `ShardBatches` or `StreamedBatches`
(trainers/torch/data.py) and run the shared loop (through `torch.compile` with `trainer.compile`); a torch process
group (gloo on CPU, NCCL on GPU) is set up before they start (trainers/torch/process_group.py); the final
checkpoint's dense model is logged to MLflow in the PyTorch flavour, taking the inputs evaluate and predict give
it."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig
from torch import nn

from contract.checkpoint import TrainState
from contract.data import DataSchema, manifest_json
from contract.mfu import peak_flops
from trainers.adapter import Adapter
from trainers.backend import Backend
from trainers.context import WorkerContext
from trainers.models import build_model
from trainers.models.text import trailing_padding_mask
from trainers.torch.adapter import TorchAdapter, load_state_file
from trainers.torch.data import Batches, ray_batches


class TorchBackend(Backend):
    """A PyTorch backend. Subclasses give `build_adapter`, and `dense_state` where a checkpoint does not hold the
    dense model in `state.pt`."""

    def ray_setup(self, cfg: DictConfig, run_id: str) -> Any:
        """A torch process group: NCCL with `trainer.use_gpu` (its Flight Recorder dumping into the run's hang/
        folder on a collective's timeout), else gloo."""
        from contract.hang import HANG_DIR
        from contract.tracking import run_dir
        from trainers.preflight import preflight_config
        from trainers.torch.process_group import TorchGroupConfig, flight_recorder_env

        nccl = cfg.trainer.use_gpu
        env = flight_recorder_env(str(run_dir(cfg.run.storage_path, run_id) / HANG_DIR)) if nccl else {}
        return TorchGroupConfig(backend="nccl" if nccl else "gloo", timeout_s=int(cfg.fault.collective_timeout_s),
                                env=env, preflight=preflight_config(cfg, run_id))

    def worker_context(self, config: dict[str, Any], cfg: DictConfig) -> WorkerContext:
        """torch's threads (`trainer.threads_per_worker`), Ray Train's device; on a GPU its peak (for `mfu`) and
        NCCL's record of collectives written on a hang."""
        import ray.train.torch

        from trainers.worker import ray_context

        torch.set_num_threads(cfg.trainer.threads_per_worker)
        device = ray.train.torch.get_device()
        if device.type != "cuda":
            return ray_context(config, cfg, device=device)
        return ray_context(config, cfg, device=device, on_hang=[dump_flight_recorder],
                           peak_flops=peak_flops(torch.cuda.get_device_name(device), cfg.trainer.precision))

    streams_files = True

    def shards(self, cfg: DictConfig, inputs: DataSchema, seed: int) -> tuple[Batches, Batches]:
        return ray_batches(cfg, inputs, seed, self.batch_group(cfg))

    def train(self, cfg: DictConfig, ctx: WorkerContext, adapter: Adapter) -> bool:
        """The shared loop, through `torch.compile` with `trainer.compile`."""
        if cfg.trainer.compile and isinstance(adapter, TorchAdapter):
            adapter.compile_forward()
        return super().train(cfg, ctx, adapter)

    def dense_state(self, directory: str) -> dict[str, torch.Tensor]:
        """The dense model's state dict a checkpoint folder holds (default: `state.pt`'s, trainers/torch/adapter.py)."""
        return load_state_file(directory)["model"]

    def log_final_model(self, tracking_uri: str, run_id: str, cfg: DictConfig, checkpoint: Any,
                        inputs: DataSchema) -> None:
        """The checkpoint's dense model, built from the model spec, in MLflow's PyTorch flavour."""
        model = build_model(cfg.model, inputs)
        with checkpoint.as_directory() as directory:
            model.load_state_dict(self.dense_state(directory))
        log_torch_model(tracking_uri, run_id, model, inputs, checkpoint)
        log_exported_model(tracking_uri, run_id, cfg, model)


def log_torch_model(tracking_uri: str, run_id: str, model: nn.Module, inputs: DataSchema, checkpoint: Any) -> None:
    """`model` (trained, as `checkpoint` holds it) logged to the MLflow run at the checkpoint's epoch, taking what
    evaluate and predict give it (`logged_form`)."""
    from contract.tracking import log_torch_model as log_model

    with checkpoint.as_directory() as directory:
        epoch = TrainState.read(directory).epoch
    log_model(tracking_uri, run_id, logged_form(model, inputs), example_input(inputs), epoch,
              model_requirements(model))


def model_requirements(model: nn.Module) -> tuple[str, ...]:
    """The pinned packages beyond torch that the classes of `model` come from (what loading it back imports)."""
    import importlib.metadata

    packages = {type(module).__module__.split(".")[0] for module in model.modules()}
    return tuple(f"{name}=={importlib.metadata.version(name)}" for name in sorted(packages & {"transformers"}))


def log_exported_model(tracking_uri: str, run_id: str, cfg: DictConfig, model: nn.Module) -> None:
    """Where the model's spec can `export` it (a Transformers folder for `model=hf`), that folder too, as the run's
    `exported_model/` artifacts, with the tokenizer the training data was made with: what `rtp export` writes."""
    import tempfile

    from contract.registry import MODELS, resolve
    from contract.tracking.models import EXPORTED_MODEL, log_folder

    spec = MODELS.get(cfg.model.name)
    if spec.export is None:
        return
    with tempfile.TemporaryDirectory() as folder:
        resolve(spec.export)(model.eval(), Path(folder), data_tokenizer(cfg.data.path))
        log_folder(tracking_uri, run_id, folder, EXPORTED_MODEL)


def data_tokenizer(data_dir: str) -> str | None:
    """The tokenizer (JSON text) the data prepared in `data_dir` was tokenised with (its manifest's `tokenizer`
    file), or None for data without one."""
    name = manifest_json(data_dir).get("tokenizer")
    return (Path(data_dir) / name).read_text() if name else None


def dump_flight_recorder(hang_folder: Path, rank: int) -> None:
    """NCCL's Flight Recorder of this rank (TORCH_NCCL_TRACE_BUFFER_SIZE, `flight_recorder_env`), written when the
    hang watcher fires, before any collective's own timeout would dump it: the file `fr_trace` reads."""
    from torch._C._distributed_c10d import _dump_nccl_trace

    (hang_folder / f"nccl_trace_rank_{rank}").write_bytes(_dump_nccl_trace())


def example_input(inputs: DataSchema) -> Any:
    """An input the logged model takes (MLflow infers its signature from it): token ids ([PAD] ids are the
    padding), or scaled features [2, width]."""
    if inputs.features.kind == "tokens":
        return np.ones((2, inputs.max_len), dtype=np.int64)
    return np.zeros((2, inputs.features.width), dtype=np.float32)


class TokenIdsModel(nn.Module):
    """A token model as it is logged: called with the ids alone (what `rtp evaluate`, `rtp predict` and a user of
    the logged model pass), it gives the model the mask of each row's ids before its [PAD] ids, as training
    does."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, trailing_padding_mask(input_ids))


def logged_form(model: nn.Module, inputs: DataSchema) -> nn.Module:
    """`model` (in eval mode) as MLflow logs it: taking `example_input(inputs)`."""
    return TokenIdsModel(model).eval() if inputs.features.kind == "tokens" else model.eval()
