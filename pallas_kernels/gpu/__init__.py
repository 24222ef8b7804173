"""GPU (Triton) Pallas attention over the paged KV pool: `ragged_paged_attention`, the same
signature and semantics as `pallas_kernels.tpu.ragged_paged_attention`; `check_supported` says
whether a model's head dim and page size fit the kernel."""

from pallas_kernels.gpu.ragged_paged_attention import (GpuBlockSizes, check_supported,
                                                       ragged_paged_attention)
from pallas_kernels.validation import validate_inputs

__all__ = ["GpuBlockSizes", "check_supported", "ragged_paged_attention", "validate_inputs"]
