"""The training recipe (contract/recipe.py) as tf-keras objects, for both TensorFlow backends: the optimizer
(AdamW without decay on biases and norms, clipping of the global gradient norm), the learning-rate schedule, the
mixed-precision policy with fp16 loss scaling, and the gradient arithmetic of accumulation.

Clipping is the optimizer's `global_clipnorm`: tf-keras' `apply_gradients` all-reduces the replicas' gradients
first and clips after (`aggregate_gradients`, then `_clip_gradients`; checked with MirroredStrategy over two
CPU devices by tests/unit/test_tf_recipe.py), and Horovod hands it gradients already averaged over ranks. So the
clipped norm is that of the averaged gradient, as in PyTorch, in the custom loops and in Keras `fit` alike.

TensorFlow and tf-keras are passed in by the callers, never imported here at module level (trainers/tf/adapter.py
says why).
"""
from __future__ import annotations

import functools
import math
from typing import Any

from contract.recipe import no_weight_decay, schedule_steps

POLICIES = {"fp32": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}
TORCH_ADAM_EPSILON = 1e-8  # PyTorch's default (Keras' is 1e-7): one recipe, the same numbers in both frameworks


def set_precision(keras: Any, precision: str) -> None:
    """Keras' global dtype policy; before the model is built. bf16/fp16 compute with float32 variables, so
    checkpoints and the logged (float32) model keep their format; the logits layer stays float32
    (trainers/models/keras_models.py) so the loss is computed in float32."""
    keras.mixed_precision.set_global_policy(POLICIES[precision])


@functools.cache
def schedule_class(keras: Any) -> type:
    """`RecipeSchedule` on this Keras' base class (defined late: Keras is imported late, see above)."""

    class RecipeSchedule(keras.optimizers.schedules.LearningRateSchedule):
        """`lr * contract.recipe.lr_factor(step, ...)` in TF ops. Keras calls it with `optimizer.iterations`, the
        count of applied updates (0 for the first, like PyTorch's LambdaLR), which is saved among the optimizer's
        variables: a restored run continues the curve where it stopped."""

        def __init__(self, lr: float, schedule: str, warmup_steps: int, total_steps: int):
            self.lr, self.schedule = lr, schedule
            self.warmup_steps, self.total_steps = warmup_steps, total_steps

        def __call__(self, step: Any) -> Any:
            import tensorflow as tf

            step = tf.cast(step, tf.float64)  # float64 as contract.recipe computes it
            warmup = float(self.warmup_steps)
            progress = tf.minimum((step - warmup) / max(1, self.total_steps - self.warmup_steps), 1.0)
            decay = {"constant": lambda: tf.ones_like(step),
                     "cosine": lambda: 0.5 * (1.0 + tf.cos(math.pi * progress)),
                     "linear": lambda: 1.0 - progress}[self.schedule]()
            factor = tf.where(step < warmup, (step + 1.0) / max(1.0, warmup), decay)
            return tf.cast(self.lr * factor, tf.float32)

        def get_config(self) -> dict:
            return {"lr": self.lr, "schedule": self.schedule, "warmup_steps": self.warmup_steps,
                    "total_steps": self.total_steps}

    return RecipeSchedule


def learning_rate(keras: Any, trainer: Any, steps_per_epoch: int) -> Any:
    """`trainer.lr`, or its schedule over `trainer.epochs` epochs of `steps_per_epoch` batches."""
    warmup, total = schedule_steps(trainer, steps_per_epoch)
    if trainer.lr_schedule == "constant" and not warmup:
        return trainer.lr
    return schedule_class(keras)(trainer.lr, trainer.lr_schedule, warmup, total)


def make_optimizer(keras: Any, trainer: Any, variables: list, steps_per_epoch: int) -> Any:
    """`trainer.optimizer` for the model's `variables` (only adamw has `trainer.weight_decay` > 0: the config
    check); fp16 wraps it in Keras' LossScaleOptimizer (dynamic loss scale)."""
    common = {"learning_rate": learning_rate(keras, trainer, steps_per_epoch), "global_clipnorm": trainer.grad_clip}
    if trainer.optimizer == "sgd":
        optimizer = keras.optimizers.SGD(momentum=trainer.momentum, **common)
    elif trainer.optimizer == "adamw":
        # Keras' own default decay is 0.004: always pass ours. Decay is decoupled: w -= lr * wd * w, as torch's.
        optimizer = keras.optimizers.AdamW(weight_decay=trainer.weight_decay, epsilon=TORCH_ADAM_EPSILON, **common)
        optimizer.exclude_from_weight_decay(
            var_list=[v for v in variables if no_weight_decay(v.name, v.shape.rank)])
    else:
        optimizer = keras.optimizers.Adam(epsilon=TORCH_ADAM_EPSILON, **common)
    if trainer.precision == "fp16":
        optimizer = keras.mixed_precision.LossScaleOptimizer(optimizer)
    return optimizer


def scaled_loss(optimizer: Any, loss: Any) -> Any:
    """The loss to differentiate (inside the tape): times the fp16 loss scale when the optimizer keeps one (a
    LossScaleOptimizer is the optimizer with `get_scaled_loss`)."""
    return optimizer.get_scaled_loss(loss) if hasattr(optimizer, "get_scaled_loss") else loss


def unscaled(optimizer: Any, grads: list) -> list:
    return optimizer.get_unscaled_gradients(grads) if hasattr(optimizer, "get_unscaled_gradients") else grads


def accumulation_share(tf: Any, grads: list, passes: int) -> list:
    """A batch's share of an accumulated step: its gradient / passes (dense: sparse embedding gradients cannot
    be summed in place). A step of `passes` batches thus applies their mean, and a short group at an epoch's end
    its sum / passes (as the PyTorch side: the loss of every batch is scaled by 1/passes)."""
    return [tf.convert_to_tensor(g) / passes for g in grads]


class VariableOptimizer:
    """The recipe's optimizer written over plain variables, for models that are not Keras models (tf_dtensor's
    `tf.Module`s with DTensor variables: tf-keras' own `mesh=` optimizers leave the variables unchanged in a
    2-client run, with TF 2.21). The arithmetic is tf-keras' (SGD with momentum, Adam, AdamW with
    decoupled decay and `no_weight_decay`, clipping by the global norm, epsilon 1e-8), so a Keras optimizer on
    plain variables is its reference (tests/support/dtensor_checks.py). Under DTensor the global norm is the norm over
    every shard: each reduction of a sharded gradient is all-reduced by DTensor.

    `apply(grads, lr, step)` runs inside the caller's `tf.function`; `lr` is the step's learning rate (the
    schedule's `contract.recipe.lr_factor` times `trainer.lr`, computed by the caller from `updates`, the
    optimizer's count of updates, which the caller advances and checkpoints). `slot_like(variable)` makes a zero
    variable laid out as `variable`."""

    BETA_1, BETA_2 = 0.9, 0.999

    def __init__(self, tf: Any, trainer: Any, variables: list, slot_like: Any):
        self.tf, self.kind, self.variables = tf, trainer.optimizer, variables
        self.momentum, self.weight_decay, self.clip = trainer.momentum, trainer.weight_decay, trainer.grad_clip
        self.updates = 0  # optimizer steps applied: the schedule's position
        self.first = [slot_like(v) for v in variables] if self.kind != "sgd" or self.momentum else []
        self.second = [slot_like(v) for v in variables] if self.kind != "sgd" else []

    def slots(self) -> list:
        """The state a checkpoint keeps, beside `updates`."""
        return [*self.first, *self.second]

    def apply(self, grads: list, lr: Any, step: Any) -> None:
        """One update; `step`: 1-based count of this update (float32, Adam's bias correction)."""
        tf = self.tf
        if self.clip is not None:
            grads, _ = tf.clip_by_global_norm(grads, self.clip)
        for i, (grad, variable) in enumerate(zip(grads, self.variables)):
            # Each slot's new value is computed once and used from the tensor: in a tf.function over DTensor
            # variables, a read after an assign in the same function sees the old value (TF 2.21).
            if self.kind == "sgd":
                if self.first:
                    velocity = self.momentum * self.first[i] - lr * grad
                    self.first[i].assign(velocity)
                    variable.assign_add(velocity)
                else:
                    variable.assign_sub(lr * grad)
                continue
            m = self.first[i] + (grad - self.first[i]) * (1 - self.BETA_1)
            v = self.second[i] + (tf.square(grad) - self.second[i]) * (1 - self.BETA_2)
            self.first[i].assign(m)
            self.second[i].assign(v)
            alpha = lr * tf.sqrt(1 - tf.pow(self.BETA_2, step)) / (1 - tf.pow(self.BETA_1, step))
            update = m * alpha / (tf.sqrt(v) + TORCH_ADAM_EPSILON)
            if self.kind == "adamw" and not no_weight_decay(variable.name, variable.shape.rank):
                update += variable * self.weight_decay * lr  # decoupled, from the weights before this step
            variable.assign_sub(update)
