"""Data: corpora and instruction examples, the one train/val split rule, the packed-data format."""
