"""Rebuilding a trained model from its workdir: `castle_jax.workdir.load_trained_model`
(in the library, so evaluation code needs nothing from `train`), kept here for
existing imports."""

from castle_jax.workdir import TrainedModel, load_trained_model  # noqa: F401
