"""The pack stage: corpora, images and instruction examples, the one train/val split rule, and the
on-disk formats training reads: the packed data and the teacher cache."""
