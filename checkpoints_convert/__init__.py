"""Convert Hugging Face safetensors checkpoints (and llama.cpp GGUF files) into Orbax checkpoints of
sarathi-jax's parameter tree.

    python -m checkpoints_convert --hf HF_DIR --out OUT_DIR [--dtype bfloat16|float32] [--quantization int8]
                                  [--force] [--verify]
    python -m checkpoints_convert --gguf FILE.gguf --out OUT_DIR [--dtype float32|bfloat16] [--quantization int8]
                                  [--force] [--verify]

`OUT_DIR` then loads with `sarathi_jax.models.load_model(OUT_DIR)` / `LLM(model=OUT_DIR)` (an int8 folder as
int8); see `converter.py` for the folder layout, the streaming and the atomicity guarantees, `orbax_writer.py`
for `--quantization int8`.
"""

from checkpoints_convert.converter import ConversionError, ConversionResult, convert, default_dtype, read_param
from checkpoints_convert.safetensors_stream import SafetensorsCheckpoint
from checkpoints_convert.gguf_source import convert_gguf
from checkpoints_convert.verifier import VerifyResult, verify

__all__ = [
    "ConversionError",
    "ConversionResult",
    "SafetensorsCheckpoint",
    "VerifyResult",
    "convert",
    "convert_gguf",
    "default_dtype",
    "read_param",
    "verify",
]
