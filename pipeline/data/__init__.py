"""The pack stage: corpora, images and instruction examples, the one train/val split rule, and the
packed-data format."""
