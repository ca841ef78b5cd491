"""Data for causal-LM pretraining: tokenizers, the embedded corpus (the Python standard library's source), token
files and Megatron-Core indexed datasets (``lightning-4d prepare-data``), window datasets that visit every token
once per epoch, weighted blends and
:class:`LMDataModule`.

Shapes and units: token ids are ints in ``[0, vocab_size)``, stored as ``uint16`` (``vocab_size <= 65536`` in a token
file, ``< 65500`` in a Megatron pair as Megatron picks) or else ``uint32`` (token file) / ``int32`` (pair); a batch is
``{"input_ids": int64 [b, s], "labels": int64 [b, s]}`` with ``b = micro_batch_size`` sequences of ``s = seq_length``
tokens; entropies and losses are in nats per token.
"""

from lightning_4d.data.corpus import (
    resolve_text_files,
    split_files,
    stdlib_corpus_files,
    stdlib_root,
    tokenize_files,
    unigram_entropy,
)
from lightning_4d.data.datamodule import LMDataModule
from lightning_4d.data.datasets import (
    BlendedDataset,
    EpochWindowDataset,
    FixedWindowDataset,
    GlobalBatchSampler,
    ResumableDataLoader,
    blending_indices,
)
from lightning_4d.data.documents import Documents
from lightning_4d.data.indexed import read_documents
from lightning_4d.data.prepare import prepare_data_main
from lightning_4d.data.token_file import read_token_file, write_token_file
from lightning_4d.data.tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "BlendedDataset",
    "ByteTokenizer",
    "Documents",
    "EpochWindowDataset",
    "FixedWindowDataset",
    "GlobalBatchSampler",
    "HFTokenizer",
    "LMDataModule",
    "ResumableDataLoader",
    "blending_indices",
    "load_tokenizer",
    "prepare_data_main",
    "read_documents",
    "read_token_file",
    "resolve_text_files",
    "split_files",
    "stdlib_corpus_files",
    "stdlib_root",
    "tokenize_files",
    "unigram_entropy",
    "write_token_file",
]
