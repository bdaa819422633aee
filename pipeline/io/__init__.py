"""Files on disk, the ground floor every layer may use: atomic writes, fingerprints and checked JSON
records. (The model-directory format is `pipeline/modeldir.py`; the inputs stage's records and the
lineage checks stand beside the stages: `stages/_input_records.py`, `stages/_lineage.py`.)
"""
