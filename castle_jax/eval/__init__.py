"""Evaluations of trained workdirs: passkey retrieval (`python -m castle_jax.eval.passkey`)
and perplexity against context length (`python -m castle_jax.eval.perplexity`); the
comparison of runs of several seeds (`python -m castle_jax.eval.compare`); the chi-square test
that LongSpec speculative sampling draws from the target's distribution
(`python -m castle_jax.eval.lossless`)."""
