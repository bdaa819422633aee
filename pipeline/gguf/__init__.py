"""The GGUF file format only: a bounds-checked header parser and memory-mapped reader, the one writer,
and llama.cpp's quantizer for the K-quants."""
