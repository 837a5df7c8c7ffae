"""benchmarks/checking_models.py writes GGUF files that tideserve loads as the architecture they name, with
the embedded model's tokenizer (llama-quantize then only changes the tensor formats)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import gguf
import pytest

from tideserve import LLM, SamplingParams
from tideserve.tokenizer.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow  # the model end to end for seconds: `make test` runs it, `-m 'not slow'` does not

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "checking_models.py"


def load_script() -> ModuleType:
    """benchmarks/ is not a package: load the script by its path."""
    spec = importlib.util.spec_from_file_location("checking_models", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("family", ["llama-1.7b", "qwen2-0.5b"])
def test_a_small_model_of_each_family_loads_with_the_embedded_tokenizer(family, smollm2_gguf_path, tmp_path):
    script = load_script()
    shape = dict(script.SHAPES[family], hidden=64, layers=2, heads=4, ffn=128,
                 kv_heads=2 if family.startswith("qwen2") else 4)
    path = script.write_f16_model(shape, tmp_path / "tiny-f16.gguf")

    llm = LLM(model=str(path), dtype="float32", max_num_seqs=1, max_model_len=256)
    arch = llm.engine.arch
    assert (arch.hidden_size, arch.num_hidden_layers, arch.num_attention_heads, arch.num_key_value_heads,
            arch.intermediate_size) == (64, 2, 4, shape["kv_heads"], 128)
    assert arch.architecture == ("Qwen2ForCausalLM" if family.startswith("qwen2") else "LlamaForCausalLM")
    reader = gguf.GGUFReader(str(path))
    assert ("blk.0.attn_q.bias" in {t.name for t in reader.tensors}) == shape["bias"]

    ours, embedded = load_tokenizer(str(path)), load_tokenizer(str(smollm2_gguf_path))
    text = "Checking models share SmolLM2's tokenizer."
    assert ours.encode(text) == embedded.encode(text)
    assert ours.eos_token_id == embedded.eos_token_id

    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
