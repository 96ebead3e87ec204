"""The config keys and their defaults as text, for `python -m train --help/--config_help`."""

from __future__ import annotations

from train.config import base_config


def config_help_text() -> str:
  """Every key of `base_config()` with its default, one per line."""
  lines = ["Config keys (override with --config.KEY=VALUE; defaults from train/config.py):"]

  def walk(config, prefix):
    for key in sorted(config.keys()):
      value = config[key]
      if hasattr(value, "keys") and not isinstance(value, dict):
        if not value.keys():
          lines.append(f"  {prefix}{key} = {{}}")
        walk(value, f"{prefix}{key}.")
      else:
        lines.append(f"  {prefix}{key} = {value!r}")

  walk(base_config(), "")
  return "\n".join(lines)
