"""Tokenizers the project makes itself: the embedded character tokenizer and its Hugging Face form."""
