"""Weight formats of linear layers: float, block-quantized (GGUF's own blocks, int8, int4)."""
from kvserve.layers.quantization.blocks import BlockWeight
from kvserve.layers.quantization.methods import QUANTIZATIONS, BlockMethod, FloatMethod, QuantConfig

__all__ = ["QUANTIZATIONS", "BlockMethod", "BlockWeight", "FloatMethod", "QuantConfig"]
