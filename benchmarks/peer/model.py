"""The model both engines of `python -m benchmarks.peer` load: an HF Llama folder with random weights.

`make_model(DIR)` writes a 60M-parameter Llama (hidden 512, 8 layers, 8 heads of 64, vocab 32000,
untied LM head, float32 safetensors) with `transformers.save_pretrained`, seeded, plus a word-level
`tokenizer.json` (token i is the word `t<i>`; ids 0, 1, 2 are <unk>, <s>, </s>). The prompts are token ids, so
neither engine needs the tokenizer to read them; it is there because vLLM's OpenAI server wants a tokenizer
(it detokenizes every stream), and with it both engines detokenize their outputs alike.
transformers and torch come with the test extras (`pip install -e ".[test]" torch==2.13.0`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class LlamaShape:
    hidden_size: int = 512
    intermediate_size: int = 1408
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    vocab_size: int = 32000
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False

    @property
    def num_params(self) -> int:
        h, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        kv = h * self.num_key_value_heads // self.num_attention_heads
        layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h  # q, o; k, v; gate, up, down; two norms
        return self.num_hidden_layers * layer + v * h * (1 if self.tie_word_embeddings else 2) + h


PEER_60M = LlamaShape()  # ~58.5M parameters: the shape the CPU comparisons with vLLM run
# Tests. Heads of 64: vLLM's CPU attention has kernels for a few head sizes only (16 is refused).
TINY = LlamaShape(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024)


def write_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """tokenizer.json + tokenizer_config.json: a word-level vocabulary covering every id of the model."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    special = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(special)}
    vocab.update({f"t{i}": i for i in range(len(special), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": 1 << 20,
    }))


def make_model(folder: str | Path, shape: LlamaShape = PEER_60M, seed: int = 0) -> Path:
    """Write a random-weight LlamaForCausalLM of `shape` (float32 safetensors) and its tokenizer to `folder`."""
    import torch
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(**asdict(shape), bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6,
                                      torch_dtype="float32")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(folder)
    write_word_tokenizer(folder, shape.vocab_size)
    return folder
