"""gem-precision: low-precision number formats for the GEM training stack."""

from gem_precision.bf16_emulation import Bf16GemmLinear, convert_to_bf16_gemms
from gem_precision.blockwise import (
    Fp8Operand,
    OperandKernelConfig,
    dequantize_blockwise,
    dequantize_operand,
    fake_quantize_blockwise,
    quantize_blockwise,
    quantize_operand,
)
from gem_precision.fsdp_fp8 import (
    MXAllGatherConfig,
    MXAllGatherWeight,
    all_gather_mx,
    enable_mx_all_gather,
    mx_all_gather_bytes,
)
from gem_precision.fused_norm import Fp8NormLinear, NormLinear, norm_quantize
from gem_precision.hadamard import (
    hadamard_matrix,
    inverse_random_hadamard_transform,
    random_hadamard_signs,
    random_hadamard_transform,
)
from gem_precision.linear import (
    ConversionReport,
    Fp8Linear,
    Fp8Recipe,
    PrecisionPolicy,
    autocast_input,
    convert_to_fp8,
    fp8_gemm_emulated,
    load_rounding_state,
    rounding_state,
)
from gem_precision.mx import (
    E8M0_BIAS,
    E8M0_NAN,
    MX_ELEMENT_DTYPES,
    MXTensor,
    dequantize_mx,
    quantize_mx,
)
from gem_precision.mx_triton import MxKernelConfig, dequantize_mx_triton, quantize_mx_triton
from gem_precision.rounding import philox_uint32, philox_uniform, stochastic_round_to_fp8
from gem_precision.saved_activations import (
    MXSavedActivations,
    SavedActivationStats,
    mx_saved_activations,
)
from gem_precision.scaled_gemm import (
    gemm_backend,
    mx_scaled_mm_nt,
    scaled_mm_nt,
    swizzle_mx_scales,
)

__all__ = [
    "MXAllGatherConfig",
    "MXAllGatherWeight",
    "all_gather_mx",
    "enable_mx_all_gather",
    "mx_all_gather_bytes",
    "MXSavedActivations",
    "SavedActivationStats",
    "mx_saved_activations",
    "Bf16GemmLinear",
    "convert_to_bf16_gemms",
    "ConversionReport",
    "E8M0_BIAS",
    "E8M0_NAN",
    "Fp8Linear",
    "Fp8Recipe",
    "MX_ELEMENT_DTYPES",
    "MXTensor",
    "PrecisionPolicy",
    "autocast_input",
    "convert_to_fp8",
    "dequantize_blockwise",
    "dequantize_mx",
    "fake_quantize_blockwise",
    "fp8_gemm_emulated",
    "load_rounding_state",
    "rounding_state",
    "hadamard_matrix",
    "inverse_random_hadamard_transform",
    "philox_uint32",
    "philox_uniform",
    "quantize_blockwise",
    "quantize_mx",
    "random_hadamard_signs",
    "random_hadamard_transform",
    "stochastic_round_to_fp8",
    "Fp8NormLinear",
    "NormLinear",
    "Fp8Operand",
    "MxKernelConfig",
    "OperandKernelConfig",
    "dequantize_mx_triton",
    "dequantize_operand",
    "gemm_backend",
    "mx_scaled_mm_nt",
    "norm_quantize",
    "quantize_mx_triton",
    "quantize_operand",
    "scaled_mm_nt",
    "swizzle_mx_scales",
]
