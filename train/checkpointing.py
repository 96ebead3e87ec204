"""The checkpointer lives in the library (`castle_jax.checkpoints`), so evaluation code
reads checkpoints without importing `train`; these names are kept here for existing
imports."""

from castle_jax.checkpoints import (  # noqa: F401
  MANIFEST_NAME,
  SET_ASIDE_DIR,
  Checkpointer,
  CheckpointError,
  file_sha256,
  verify_step,
  write_manifest,
)
