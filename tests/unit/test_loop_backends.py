"""Stop/resume parity and the metric set for the Lightning, DeepSpeed (ZeRO-2), Horovod (torch, tf), tf_mwms,
tf_dtensor and tf_ps adapters on the shared loop, each attempt in a fresh process
(tests/support/loop_backends.py), no Ray cluster (tf_ps with real TensorFlow servers); and the loss-parity gate:
every one of them trains DDP's loss curve from DDP's recipe, seed and data. Stop/resume of DDP and TP:
tests/unit/test_loop.py and tests/parallel/test_tp_loop.py. Horovod runs as a lone process: the 2-rank paths are in
tests/integration."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.conftest import fresh_tf_process
from tests.support.loop_harness import attempt_from_json, check_metric_set, check_parity, last_checkpoint

pytestmark = pytest.mark.slow  # each backend's worker in a process of its own (TF, Horovod, DeepSpeed, Lightning)


def attempt(backend: str, folder, name: str, restore=None):
    restored = [str(restore)] if restore else []
    return attempt_from_json(fresh_tf_process("tests.support.loop_backends", backend, str(folder / backend), name,
                                              *restored))


def final_weights(folder, backend: str) -> np.ndarray:
    """A TF run's final weights (run.dump_params_dir, tests/support/loop_backends.py), flattened."""
    with np.load(folder / backend / "straight" / "params" / "rank0.npz") as dump:
        return np.concatenate([dump[f"arr_{i}"].ravel() for i in range(len(dump.files))])


def straight_runs_wanted(request) -> list[str]:
    """The uninterrupted runs the selected tests of this module compare (their `straight` marks), in test order."""
    wanted = []
    for item in request.session.items:
        mark = item.get_closest_marker("straight") if item.module is request.module else None
        params = item.callspec.params if hasattr(item, "callspec") else {}
        for template in mark.args if mark else ():
            run = template.format(**params)
            if run not in wanted:
                wanted.append(run)
    return wanted


@pytest.fixture(scope="module")
def straight(request, tmp_path_factory):
    """`straight(backend)`: that backend's uninterrupted run, run once for every test of this module that
    compares runs; `straight.folder` holds them. They run one after another in a thread of their own, from the
    module's start, in the order the tests want them: each attempt is one thread (TensorFlow's intra- and inter-op
    pools are set to 1), so they take the second core while the tests run their other attempts."""
    folder = tmp_path_factory.mktemp("straight")
    lane = ThreadPoolExecutor(max_workers=1, thread_name_prefix="straight")
    runs = {backend: lane.submit(attempt, backend, folder, "straight") for backend in straight_runs_wanted(request)}

    def run(backend: str):
        if backend not in runs:  # a test without its mark: queued behind every run already asked for
            runs[backend] = lane.submit(attempt, backend, folder, "straight")
        return runs[backend].result()
    run.folder = folder
    yield run
    lane.shutdown(cancel_futures=True)


# 2 batches per optimizer step everywhere but tf_mwms_steps_per_call (4 steps per call of its compiled loop): the stop
# at step 10 lands on an update boundary (mid-epoch for Horovod, 20 steps per epoch). The TF runs also schedule the
# LR and clip (horovod_tf: AdamW with decay; see tests/support/loop_backends.py): the restored optimizer's update count
# must continue the schedule. The straight run of tf_mwms_custom is also one of the runs compared below.
@pytest.mark.straight("{backend}")
# lightning_user and ZeRO-3 stop and resume the same way (a user's module through the same callback; ZeRO-3 at 2 ranks:
# tests/parallel/test_deepspeed_loop.py)
@pytest.mark.parametrize("backend", ["lightning", "deepspeed_zero2", "horovod_torch", "horovod_tf", "tf_mwms_custom",
                                     "tf_mwms_steps_per_call", "tf_dtensor", "tf_ps"])
def test_stop_resume_parity(tmp_path, straight, backend):
    runs = {"straight": straight(backend), "stopped": attempt(backend, tmp_path, "stopped")}
    runs["resumed"] = attempt(backend, tmp_path, "resumed", last_checkpoint(tmp_path / backend / "stopped"))
    # The same ops in the same order after a restore: float32 results agree to rounding.
    check_parity(runs, epochs=2, text=False, rtol=1e-5, atol=1e-6)
    rows_per_step = 32 if backend == "tf_mwms_custom" else 16  # 2 devices per worker: 2 x 16; tf_dtensor: 2 x 8
    assert len(runs["straight"].recorder.step_losses) == 320 // rows_per_step * 2


def test_a_users_lightning_module_trains_with_its_own_step_and_optimizer(tmp_path):
    """A model spec's own LightningModule (tests/support/user_lightning.py; its stop/resume parity is above) is
    trained by its `training_step` and `configure_optimizers`, not the recipe: at its `model.lr=0` the weights never
    move, so both epochs' mean loss over the same rows is the same (the config's `trainer.lr=0.01` would lower
    it), while the step losses differ batch to batch. The contract's metric set holds."""
    frozen = attempt("lightning_user_frozen", tmp_path, "straight")
    assert frozen.finished
    check_metric_set(frozen.recorder, 2, text=False)
    epochs = frozen.recorder.epochs
    np.testing.assert_allclose(epochs[2]["train_loss"], epochs[1]["train_loss"], rtol=1e-6)
    assert len(set(frozen.recorder.step_losses.values())) > 10


def test_a_users_lightning_module_resumes_with_its_configs_learning_rate(tmp_path):
    """A user's LightningModule stopped at `model.lr=0.1` and resumed with `model.lr=0` (a user lowering the rate,
    a PBT trial taking another's checkpoint) trains with 0, not the checkpoint's 0.1: the weights it finishes with
    are the stopped checkpoint's, bit for bit, while the resumed steps' losses still vary."""
    import torch

    from trainers.torch.lightning_checkpoint import module_state

    stopped = attempt("lightning_user", tmp_path, "stopped")
    assert not stopped.finished
    checkpoint = last_checkpoint(tmp_path / "lightning_user" / "stopped")
    resumed = attempt("lightning_user_frozen", tmp_path, "resumed", checkpoint)
    assert resumed.finished and resumed.recorder.resumed == [0]
    assert len(set(resumed.recorder.step_losses.values())) > 10
    before, after = module_state(str(checkpoint)), module_state(str(resumed.checkpoint))
    assert before.keys() == after.keys()
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=0)


def test_a_users_lightning_module_is_the_logged_model(tmp_path, mlflow_server):
    """trainer=lightning logs a spec's own LightningModule itself (its `forward` takes the batch's inputs): loaded
    back from MLflow, it gives the trained module's outputs."""
    logged = fresh_tf_process("tests.support.loop_backends", "logged_lightning_module", str(tmp_path), mlflow_server)
    assert logged["trained"]
    assert logged["max_output_gap"] < 1e-5


def test_keras_fit_keeps_the_contract(tmp_path):
    """Keras `fit` hands its epochs to the same loop: the text metric set (tokens_per_s) and a checkpoint of
    the same schema, which the custom loop's resume reads. Here in bf16, with 3 batches per update."""
    fit = attempt("tf_mwms_fit", tmp_path, "straight")
    assert fit.finished
    check_metric_set(fit.recorder, 2, text=True)
    # log_every_n_steps=1, but fit hands the loss over every tf_steps_per_execution=4 fit steps of 3 batches
    # each: after batch 12 and at the epoch's end (7 fit steps, the last one of 2 batches), 20 batches an epoch.
    assert sorted(fit.recorder.step_losses) == [12, 20, 32, 40]


def test_tf_ps_keras_fit_keeps_the_contract_and_its_checkpoint_resumes_in_the_custom_loop(tmp_path):
    """Keras `fit` driving tf_ps' coordinator (weights split over 2 parameter servers) hands its epochs to the loop:
    the metric set every epoch; its epoch-1 checkpoint (whole values, tf_mwms' files) resumes in the custom loop,
    which trains epoch 2 from it."""
    fit = attempt("tf_ps_fit", tmp_path, "straight")
    assert fit.finished
    check_metric_set(fit.recorder, 2, text=False)
    resumed = attempt("tf_ps", tmp_path, "resumed", tmp_path / "tf_ps_fit" / "straight" / "checkpoint_1")
    assert resumed.finished and resumed.recorder.resumed == [1] and sorted(resumed.recorder.epochs) == [1, 2]
    assert resumed.recorder.epochs[1] == fit.recorder.epochs[1]  # epoch 1 as the checkpoint recorded it
    assert min(resumed.recorder.step_losses) == 21  # epoch 2's steps only
    assert resumed.recorder.epochs[2]["train_loss"] < fit.recorder.epochs[1]["train_loss"]


@pytest.mark.straight("tf_one_device", "tf_mwms_custom", "tf_two_devices_fit")
def test_two_devices_take_the_steps_of_one_device_with_the_double_batch(straight):
    """`trainer.devices_per_worker=2` (MirroredStrategy over two logical CPU devices) with 16 rows per replica takes the
    same steps as one device with 32 rows: same rows per step, gradients averaged over the global batch, then
    clipped (per-replica clipping would part the curves). Keras `fit` over the same two devices logs the mean
    loss of each window of that curve between its callbacks (every 2 fit steps of 2 batches, 5 per epoch)."""
    one = straight("tf_one_device").recorder.curve()
    two = straight("tf_mwms_custom").recorder.curve()
    fit = straight("tf_two_devices_fit").recorder
    assert len(one) == len(two) == 20  # 320 rows / 32 per step x 2 epochs
    np.testing.assert_allclose(two, one, rtol=1e-4, atol=1e-5)
    logged = sorted(fit.step_losses)
    assert logged == [4, 8, 10, 14, 18, 20]
    windows = [two[start:end].mean() for start, end in zip([0, *logged[:-1]], logged)]
    np.testing.assert_allclose([fit.step_losses[s] for s in logged], windows, rtol=1e-3, atol=1e-4)


@pytest.mark.straight("{variant}", "{reference}")
@pytest.mark.parametrize("variant, reference, steps", [("tf_reduce_to_one", "tf_one_device", 20),
                                                      ("tf_hierarchical_copy", "tf_one_device", 20),
                                                      ("tf_central_storage", "tf_big_batch_constant_lr", 10)])
def test_every_way_of_summing_over_devices_takes_the_same_steps(straight, variant, reference, steps):
    """The other ways one worker sums over its two devices (`trainer.tf_cross_device_ops`, or CentralStorageStrategy's
    variables on one device, `trainer.tf_strategy=central_storage`) take the steps of one device with the double
    batch, as MirroredStrategy's default does (above); with the recipe's clipping, and its accumulation and schedule
    except under central storage (config errors there: 2 devices x 32 rows at a constant rate against 64 rows on
    one)."""
    curve = straight(variant).recorder.curve()
    assert len(curve) == steps
    np.testing.assert_allclose(curve, straight(reference).recorder.curve(), rtol=1e-4, atol=1e-5)


@pytest.mark.straight("tf_big_batch", "tf_one_device", "tf_mwms_custom", "tf_two_devices_fit")
def test_accumulation_takes_the_steps_of_the_whole_batch(straight):
    """grad_accum=2 over batches of 32 rows (one device, two devices, Keras `fit`) ends on the weights of one
    step per batch of 64 rows: each update applies the mean gradient of the same 64 rows, clipped alike, and the
    schedule counts the same 10 updates. SGD's updates scale with the gradient, so a wrong 1/grad_accum shows.
    Tolerance: float32 sums in another order; the weights (|w| < 0.5, float32 spacing 3e-8 there) agreed to 3e-8
    here, a wrong update to ~1e-3 (bf16's rounding alone moves them by 2e-3)."""
    assert straight("tf_big_batch").finished
    whole = final_weights(straight.folder, "tf_big_batch")
    for backend in ("tf_one_device", "tf_mwms_custom", "tf_two_devices_fit"):
        assert straight(backend).finished
        np.testing.assert_allclose(final_weights(straight.folder, backend), whole, rtol=0, atol=2e-7,
                                   err_msg=backend)


@pytest.mark.straight("tf_one_device", "tf_bf16")
def test_bf16_loss_curve_stays_close_to_fp32(straight):
    """precision=bf16 (Keras mixed_bfloat16: bf16 matmuls, float32 weights, logits and loss) on the fp32 run's
    batches: its step losses differ (bf16 keeps 8 bits of mantissa) but stay within 0.1 of fp32's, a loss that
    falls from 3.0 to 0.5 (measured: at most 0.026 apart, 4%)."""
    fp32 = straight("tf_one_device").recorder.curve()
    bf16 = straight("tf_bf16").recorder.curve()
    assert not np.array_equal(bf16, fp32)  # bf16 really ran
    np.testing.assert_allclose(bf16, fp32, rtol=0, atol=0.1)


@pytest.mark.straight("parity_ddp", "parity_{backend}")
@pytest.mark.parametrize("backend", ["lightning", "deepspeed", "horovod_torch", "horovod_tf", "tf_mwms_custom",
                                     "tf_mwms_fit", "tf_dtensor", "tf_ps"])
def test_loss_parity_with_the_ddp_reference(straight, backend):
    """The loss-parity gate: one seed, data order and recipe (tests/support/loop_backends.py: PARITY, the MNIST MLP with
    SGD and momentum, 40 steps) through each backend's worker give DDP's loss curve step for step: the same
    initial weights in both frameworks (trainers/models/portable_init.py), the same shuffle, the same update.
    Tolerance: PyTorch backends run the same kernels as DDP (measured: identical); TensorFlow's float32 kernels
    sum in another order (measured: at most 7.5e-7 apart, 1.5e-4 relative, on losses from 3.1 down to 2e-4).
    A backend off by one step, one initial weight or one learning-rate factor is off by far more."""
    reference = straight("parity_ddp").recorder
    other = straight(f"parity_{backend}").recorder
    assert len(reference.curve()) == 40  # 320 rows / 16 x 2 epochs, every step logged
    exact = backend in ("lightning", "deepspeed", "horovod_torch")
    tolerance = dict(rtol=0, atol=1e-7) if exact else dict(rtol=1e-3, atol=1e-5)
    np.testing.assert_allclose(other.curve(), reference.curve(), **tolerance)
    for epoch in (1, 2):
        assert other.epochs[epoch]["test_accuracy"] == reference.epochs[epoch]["test_accuracy"]
        np.testing.assert_allclose(other.epochs[epoch]["train_loss"], reference.epochs[epoch]["train_loss"],
                                   **tolerance)


def dropout_draws(kind: str, folder):
    """What `python -m tests.support.loop_backends <kind>_dropout` returns."""
    return fresh_tf_process("tests.support.loop_backends", f"{kind}_dropout", str(folder))


def test_tf_ps_workers_draw_their_own_dropout_masks(tmp_path):
    """Under tf_ps the chief traces each step once and every worker runs it: worker 1's k-th step must not draw
    worker 0's k-th masks (tf-keras' default stateful dropout ops did, all of them: every worker's kernels started
    from the seeds the chief traced), and no two steps may draw the same masks."""
    draws = {int(worker): [tuple(logits) for logits in runs]
             for worker, runs in dropout_draws("ps", tmp_path).items()}
    assert min(len(runs) for runs in draws.values()) >= 4
    assert not any(first == second for first, second in zip(draws[0], draws[1]))
    every = draws[0] + draws[1]
    assert len(set(every)) == len(every)


def test_tf_dtensor_batch_shards_draw_their_own_dropout_masks(tmp_path):
    """tf_dtensor's stateless dropout, one seed per step on a 2 x 2 mesh, identical input rows: the two devices of
    a batch coordinate (one model replica, split over the model axis) draw the same masks, as replicated
    activations need; the two batch coordinates draw different ones, as one process would for different rows."""
    first, first_twin, second, second_twin = (np.array(logits) for logits in dropout_draws("dtensor", tmp_path))
    np.testing.assert_array_equal(first_twin, first)
    np.testing.assert_array_equal(second_twin, second)
    assert first.shape == (4, 10) and not np.any(np.all(first == second, axis=1))
