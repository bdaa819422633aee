"""The library of the small-LM experiment pipeline: torch, numpy, gguf and tokenizers only.

Nothing here imports hydra, omegaconf or dvc; only `pipeline.tracking` touches mlflow. One module
per DVC stage holds that stage's work (`pack`, `donor`, `realize`, `train`, `export`, `evaluate`,
plus the `generate` tool); the packages below are the layers they stand on:

- `gguf/`: GGUF files (checked reader, one writer), the tokenizer and chat template they carry.
- `models/`: the config dataclass and modules (llama, gpt2), their GGUF mapping, the loss, decoding.
- `data/`: corpora and instruction examples, the train/val split, the packed-data format.
- `finetune/`: LoRA, QLoRA's quantized base, adapter files (llama.cpp GGUF, PEFT).
- `training/`: the one loop and its parts (runtime, optimizer, batches, validation, resume).
- `config/` (schemas), `modeldir` (model directories), `files` (atomic writes, fingerprints),
  `errors` (the one error shape), `tracking` (MLflow behind a plain interface).
"""
