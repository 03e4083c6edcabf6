"""gem-precision: low-precision number formats for the GEM training stack."""

from gem_precision.mx import (
    E8M0_BIAS,
    E8M0_NAN,
    MX_ELEMENT_DTYPES,
    MXTensor,
    dequantize_mx,
    quantize_mx,
)

__all__ = [
    "E8M0_BIAS",
    "E8M0_NAN",
    "MX_ELEMENT_DTYPES",
    "MXTensor",
    "dequantize_mx",
    "quantize_mx",
]
