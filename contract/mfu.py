"""Model FLOPs utilisation: what the training achieved against what the device can do.

A run knows its model's training FLOPs per sample (`ModelSpec.flops_per_sample`, or counted on the PyTorch model:
trainers/model_flops.py). Each epoch rank 0 logs `tflops_per_rank`: those FLOPs times the run's samples per second,
shared over the ranks; and `mfu`, that over one device's dense peak at the run's precision, where the device is in
the table below. CPUs have no entry: their peak depends on the model, the clock and the vector units in use, so
there the achieved figure stands alone.
"""
from __future__ import annotations

# Dense (no sparsity) peak FLOP/s of one GPU by the run's precision: fp32 is the CUDA cores' rate (PyTorch's
# default matrix products do not use TF32), bf16 and fp16 the tensor cores'. Matched in this order by a substring
# of the device's name (torch.cuda.get_device_name), so the PCIe parts come before their SXM siblings.
PEAK_FLOPS: tuple[tuple[str, dict[str, float], str], ...] = (
    ("H100 PCIe", {"fp32": 51.2e12, "bf16": 756.5e12, "fp16": 756.5e12},
     "NVIDIA H100 Tensor Core GPU datasheet (PCIe; tensor figures halved: the sheet quotes them with sparsity)"),
    ("H100", {"fp32": 66.9e12, "bf16": 989.4e12, "fp16": 989.4e12},
     "NVIDIA H100 Tensor Core GPU datasheet (SXM; tensor figures halved: the sheet quotes them with sparsity)"),
    ("H200", {"fp32": 66.9e12, "bf16": 989.4e12, "fp16": 989.4e12},
     "NVIDIA H200 Tensor Core GPU datasheet (SXM; tensor figures halved: the sheet quotes them with sparsity)"),
    ("A100", {"fp32": 19.5e12, "bf16": 312e12, "fp16": 312e12}, "NVIDIA A100 Tensor Core GPU datasheet"),
    ("V100", {"fp32": 15.7e12, "fp16": 125e12}, "NVIDIA V100 Tensor Core GPU datasheet (SXM2)"),
    ("L40S", {"fp32": 91.6e12, "bf16": 362.05e12, "fp16": 362.05e12},
     "NVIDIA L40S datasheet (tensor figures without sparsity)"),
    ("L40", {"fp32": 90.5e12, "bf16": 181.05e12, "fp16": 181.05e12},
     "NVIDIA L40 datasheet (tensor figures without sparsity)"),
    ("A10", {"fp32": 31.2e12, "bf16": 125e12, "fp16": 125e12}, "NVIDIA A10 Tensor Core GPU datasheet (dense)"),
    ("L4", {"fp32": 30.3e12, "bf16": 121e12, "fp16": 121e12}, "NVIDIA L4 Tensor Core GPU datasheet (dense)"),
)


def peak_flops(device_name: str, precision: str) -> float | None:
    """One device's dense peak FLOP/s at `precision` (fp32, bf16, fp16), or None when it is not in the table."""
    for key, peaks, _ in PEAK_FLOPS:
        if key in device_name:
            return peaks.get(precision)
    return None


def utilisation(flops_per_sample: float, samples_per_s: float, ranks: int, peak: float | None) -> dict[str, float]:
    """`tflops_per_rank` (the run's achieved model FLOP/s shared over its ranks), and `mfu` against `peak`."""
    per_rank = flops_per_sample * samples_per_s / ranks
    figures = {"tflops_per_rank": per_rank / 1e12}
    if peak:
        figures["mfu"] = per_rank / peak
    return figures
