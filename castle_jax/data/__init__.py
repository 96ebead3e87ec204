"""Tokenizers, the embedded python_stdlib corpus and grain LM pipelines."""
