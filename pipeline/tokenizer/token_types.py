"""llama.cpp's token types (gguf.TokenType / LLAMA_TOKEN_TYPE_*) and SentencePiece's visible space: one
home for the names the tokenizer and its SentencePiece decoder both read."""

TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

SPACE_MARK = "\u2581"  # SentencePiece's visible space
