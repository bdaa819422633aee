"""The numerical kernels the modules call: RMSNorm, RoPE and SwiGLU with their own backward (plain
torch and Triton), padding-free attention for packed rows, and the chunked head + loss.
"""
