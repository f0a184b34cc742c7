"""The default local embedder: all-MiniLM-L6-v2 exported to int8 ONNX, held to the torch fp32 reference."""

import dataclasses
import json

import numpy as np
import pytest

from pipelines.models import onnx_model
from pipelines.models.embedders import (BatchedOnnxEmbedder, OnnxEmbedder, TorchEmbedder, embedder_for,
                                        make_embedder)
from pipelines.settings import REPO_ROOT, load_settings

SCIFACT = REPO_ROOT.parent / "shared" / "datasets" / "scifact"


@pytest.fixture(scope="module")
def sample() -> list[str]:
    """Abstracts (some longer than the model reads), short queries, identifiers and a very long text."""
    lines = (SCIFACT / "corpus.jsonl").read_text().splitlines()[:40]
    abstracts = [json.loads(line)["title"] + "\n\n" + json.loads(line)["text"] for line in lines]
    queries = ["What is the leave policy?", "HR-2024-047", "AVX-039 replacement interval", "0-dimensional biomaterials"]
    return abstracts + queries + [" ".join(abstracts)]


def test_int8_vectors_agree_with_the_fp32_reference(embedder, sample):
    assert isinstance(embedder, OnnxEmbedder), "the default local embedder is the int8 graph"
    int8 = embedder.embed(sample)
    fp32 = TorchEmbedder().embed(sample)
    assert int8.shape == fp32.shape == (len(sample), 384) and int8.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(int8, axis=1), 1.0, atol=1e-5)
    cosine = (int8 * fp32).sum(axis=1)
    assert cosine.min() >= 0.98, f"lowest cosine {cosine.min():.4f} on {sample[int(cosine.argmin())][:60]!r}"
    # Same ranking as the reference for a query against the abstracts it was drawn from.
    assert np.argmax(int8[:40] @ int8[43]) == np.argmax(fp32[:40] @ fp32[43])


def test_inputs_never_exceed_the_model_input_limit(embedder, sample):
    lengths = [len(ids) for ids in embedder.token_ids(sample)]
    assert max(lengths) == embedder.max_sequence == 256 and min(lengths) > 2


def test_a_texts_vector_is_the_same_bytes_in_any_batch(embedder, sample):
    """Dynamic quantization scales activations over the whole input tensor: a batch (and its padding) used to
    move a text's vector (cosine 0.994 to itself alone), so what else was embedded leaked into scores."""
    alone = [embedder.embed([text])[0].tobytes() for text in sample]
    everything = embedder.embed(sample)
    backwards = embedder.embed(sample[::-1])[::-1]
    shuffled_order = np.random.default_rng(7).permutation(len(sample))
    shuffled = np.empty_like(everything)
    shuffled[shuffled_order] = embedder.embed([sample[i] for i in shuffled_order])
    pairs = [embedder.embed([sample[i], sample[-1 - i]])[0] for i in range(len(sample))]  # two at a time
    for vectors in (everything, backwards, shuffled, pairs):
        assert [v.tobytes() for v in vectors] == alone
    assert embedder.embed(sample[:3]).dtype == np.float32 and embedder.embed([]).shape == (0, 384)


def test_export_is_cached_reused_and_reproducible(tmp_path, monkeypatch, embedder):
    cached = onnx_model.int8_model(embedder.cache_dir)  # exported by the session fixture
    stamp = cached.stat().st_mtime_ns

    def no_second_export(path):
        raise AssertionError("exported again although the cache holds the model")

    with monkeypatch.context() as patch:
        patch.setattr(onnx_model, "_export_fp32", no_second_export)
        assert onnx_model.int8_model(embedder.cache_dir) == cached
        fresh = OnnxEmbedder(embedder.cache_dir)
        assert fresh.embed(["reuse the cached graph"]).shape == (1, 384)
    assert cached.stat().st_mtime_ns == stamp
    assert [p.name for p in embedder.cache_dir.iterdir()] == [cached.name], "no temporary files left behind"

    again = onnx_model.int8_model(tmp_path / "elsewhere")
    assert again.name == cached.name and again.read_bytes() == cached.read_bytes(), "export is deterministic"


def test_embedder_choice_and_model_keys(monkeypatch, tmp_path):
    monkeypatch.setenv("KB_HOME", str(tmp_path))
    monkeypatch.delenv("KB_MODEL_CACHE", raising=False)
    settings = load_settings()
    default = make_embedder(settings)
    assert isinstance(default, OnnxEmbedder) and default.cache_dir == tmp_path / "models"
    assert isinstance(make_embedder(dataclasses.replace(settings, embedder="local-fp32")), TorchEmbedder)
    # Queries are embedded by the model that made the stored vectors, whichever is configured now.
    assert isinstance(embedder_for(TorchEmbedder.model_key, settings), TorchEmbedder)
    assert isinstance(embedder_for(OnnxEmbedder.model_key, settings), OnnxEmbedder)
    assert TorchEmbedder.model_key != OnnxEmbedder.model_key, "int8 vectors are their own vector space"
    # A store built with the batched recipe (r2) keeps serving with it until an operator switches.
    assert type(embedder_for(BatchedOnnxEmbedder.model_key, settings)) is BatchedOnnxEmbedder
    assert BatchedOnnxEmbedder.model_key != OnnxEmbedder.model_key, "r3 vectors differ from r2's: a new model key"
    monkeypatch.setenv("KB_EMBEDDER", "onnx")
    with pytest.raises(ValueError, match="KB_EMBEDDER must be one of local, local-fp32, openai"):
        load_settings()
