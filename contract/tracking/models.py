"""The trained model in MLflow: logged (PyTorch flavour; Keras' is logged by trainers/tf/adapter.py) and
registered as a version of a registered model."""
from __future__ import annotations

import os
import sys
from types import ModuleType

from contract.tracking.server import mlflow_client


def mlflow_pytorch() -> ModuleType:
    """`mlflow.pytorch`, without the Lightning autologging it imports whenever pytorch_lightning is installed (the
    `lightning` extra): nothing here autologs, and those imports (Lightning, torchmetrics, scipy) would cost every
    driver that logs a PyTorch model seconds. A None entry in sys.modules makes that one import fail, which MLflow
    takes as Lightning being absent; the entry goes at once, so Lightning imports as usual for whatever asks next."""
    if "mlflow.pytorch" in sys.modules or "pytorch_lightning" in sys.modules:
        import mlflow.pytorch

        return mlflow.pytorch
    sys.modules["pytorch_lightning"] = None  # type: ignore[assignment]
    try:
        import mlflow.pytorch
    finally:
        del sys.modules["pytorch_lightning"]
    return mlflow.pytorch


def log_torch_model(uri: str, run_id: str, model, input_example, epoch: int,
                    requirements: tuple[str, ...] = ()) -> None:
    """The model as the run's MLflow model (PyTorch flavour), linked to the metrics of `epoch`, the one whose
    checkpoint it holds (the logged model's page in the UI shows them). `requirements`: pip requirements of the
    model's own classes beyond torch's (`transformers==...` for a Transformers model)."""
    import mlflow
    import torch

    mlflow.set_tracking_uri(uri)
    # log_model checks the input example by loading the model back, on the GPU where this driver sees one; a
    # torch.export model of CPU weights loads on the CPU only.
    os.environ.setdefault("MLFLOW_DEFAULT_PREDICTION_DEVICE", "cpu")
    # The fluent API is what log_model uses; the driver sets the final status right after this.
    mlflow.start_run(run_id=run_id, log_system_metrics=False)
    try:
        # Explicit requirements: MLflow's inference imports and scans modules, seconds for nothing here.
        torch_req = f"torch=={torch.__version__.split('+')[0]}"
        mlflow_pytorch().log_model(model, name="model", input_example=input_example,
                                   pip_requirements=[torch_req, *requirements], step=epoch)
    finally:
        mlflow.end_run()


EXPORTED_MODEL = "exported_model"  # a run's model in its framework's own format (model spec `export`), artifacts


def log_folder(uri: str, run_id: str, folder: str, artifact_path: str) -> None:
    """Every file of `folder` as the run's artifacts under `artifact_path`."""
    mlflow_client(uri).log_artifacts(run_id, folder, artifact_path)


def logged_models(uri: str, run_id: str) -> list:
    """The models run `run_id` logged (MLflow's LoggedModels, each with its `model_uri`)."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    experiment_id = mlflow_client(uri).get_run(run_id).info.experiment_id
    return mlflow.search_logged_models(experiment_ids=[experiment_id], output_format="list",
                                       filter_string=f"source_run_id = '{run_id}'")


def register_logged_model(uri: str, run_id: str, name: str) -> str:
    """Register the model the run logged as a new version of registered model `name` (created if new); tags the
    version and the run with each other. Returns the version."""
    import mlflow

    client = mlflow_client(uri)
    models = logged_models(uri, run_id)
    if len(models) != 1:
        raise RuntimeError(f"run {run_id} logged {len(models)} models, not one: nothing registered as {name}")
    version = mlflow.register_model(models[0].model_uri, name, tags={"training_run_id": run_id}).version
    client.set_tag(run_id, "registered_model", f"{name}/{version}")
    return str(version)
