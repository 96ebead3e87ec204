"""Evaluations: passkey retrieval."""
