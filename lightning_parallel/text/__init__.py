"""Text data for causal LMs: the model's tokenizer, local files through Hugging Face ``datasets`` (``hf_text``
documents, ``sft`` instruction samples), a memory-mapped token cache built once and read by every rank, and the
torch datasets over it (batches that :class:`~lightning_parallel.hf.HFCausalLM` reads)."""

from lightning_parallel.text.cache import TokenCache, build_token_cache, open_token_cache, token_dtype
from lightning_parallel.text.dataset import PackedSamples, PaddedSamples, TextBlocks, pack_rows, text_dataset
from lightning_parallel.text.samples import TextDataSettings
from lightning_parallel.text.tokenizer import TextTokenizer, check_vocab_fits, load_tokenizer

__all__ = [
    "PackedSamples",
    "PaddedSamples",
    "TextBlocks",
    "TextDataSettings",
    "TextTokenizer",
    "TokenCache",
    "build_token_cache",
    "check_vocab_fits",
    "load_tokenizer",
    "open_token_cache",
    "pack_rows",
    "text_dataset",
    "token_dtype",
]
