"""Using a model after training: decoding (a llama packed for it, sampling as llama.cpp samples), the
generate tool and the chat session.
"""
