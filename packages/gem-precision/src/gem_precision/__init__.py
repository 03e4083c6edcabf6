"""gem-precision: low-precision number formats for the GEM training stack."""

from gem_precision.blockwise import (
    dequantize_blockwise,
    fake_quantize_blockwise,
    quantize_blockwise,
)
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
    convert_to_fp8,
    fp8_gemm_emulated,
)
from gem_precision.mx import (
    E8M0_BIAS,
    E8M0_NAN,
    MX_ELEMENT_DTYPES,
    MXTensor,
    dequantize_mx,
    quantize_mx,
)
from gem_precision.rounding import philox_uint32, philox_uniform, stochastic_round_to_fp8

__all__ = [
    "ConversionReport",
    "E8M0_BIAS",
    "E8M0_NAN",
    "Fp8Linear",
    "Fp8Recipe",
    "MX_ELEMENT_DTYPES",
    "MXTensor",
    "PrecisionPolicy",
    "convert_to_fp8",
    "dequantize_blockwise",
    "dequantize_mx",
    "fake_quantize_blockwise",
    "fp8_gemm_emulated",
    "hadamard_matrix",
    "inverse_random_hadamard_transform",
    "philox_uint32",
    "philox_uniform",
    "quantize_blockwise",
    "quantize_mx",
    "random_hadamard_signs",
    "random_hadamard_transform",
    "stochastic_round_to_fp8",
]
