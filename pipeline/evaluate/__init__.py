"""The evaluate stage and the scoring tools: the export read back and measured (text and images),
llama.cpp parity, and lm-eval's view of our models.
"""
