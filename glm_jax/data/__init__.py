"""Data: the standard-library corpus, the byte-level BPE tokenizer and training batches."""
