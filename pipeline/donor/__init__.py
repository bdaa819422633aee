"""The donor GGUF: where it is, how each recipe loads it, and what the donor stage measures on the
corpus (the embedding PCA, the whole-network calibration).
"""
