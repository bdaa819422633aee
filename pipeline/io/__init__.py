"""Files on disk that every stage shares: atomic writes and fingerprints, checked JSON records, the
model-directory format, the inputs stage's records and the lineage checks that compare a config with them.
"""
