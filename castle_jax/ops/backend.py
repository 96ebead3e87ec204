"""How every op picks its implementation: one pattern, one logger.

An op declares its implementations in a table (name -> `Implementation`), each with
an `unsupported_reason()` for the call at hand (None: it can run; else why not, naming
the argument and the fix), and a default order. Then `choose(...)`:
  - implementation=None: walks the default order and takes the first implementation
    that can run, logging the choice and why the others before it were skipped at
    debug level on the "castle_jax.ops.backend" logger;
  - an explicit name that cannot run: ValueError naming the argument, the reason and
    the alternatives (only the default falls back);
  - an unknown name: ValueError listing the known ones.
Each `unsupported_reason` runs at most once per call.

An implementation can be restricted to some backends for the default choice only
(`default_backends`): the Pallas kernels run anywhere when asked for (interpret mode
on CPU, for tests) but are the default only on a GPU.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Mapping, Sequence

import jax

logger = logging.getLogger(__name__)


def _always_supported() -> str | None:
  return None


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One way an op can run.

  Attributes:
    unsupported_reason: () -> None when it can run these inputs, else a message.
    default_backends: jax backends on which the default choice may take it (None: all).
  """

  unsupported_reason: Callable[[], str | None] = _always_supported
  default_backends: tuple[str, ...] | None = None


def choose(
  op: str,
  requested: str | None,
  implementations: Mapping[str, Implementation],
  default_order: Sequence[str],
  *,
  argument: str = "implementation",
) -> str:
  """The implementation to run (see the module docstring).

  Args:
    op: the op's name, for messages and the log.
    requested: the caller's choice, or None for the default.
    implementations: every implementation the op accepts, by name.
    default_order: the names the default tries, best first; the last one should
      always be supported.
    argument: the argument's name in messages (e.g. "model.attention_impl" callers
      pass "implementation").

  Raises:
    ValueError: an unknown name, or an explicit choice that cannot run.
  """
  names = tuple(implementations)
  if requested is None:
    skipped = []
    for name in default_order:
      backends = implementations[name].default_backends
      if backends is not None and jax.default_backend() not in backends:
        skipped.append(f"{name}: not a default on backend {jax.default_backend()!r}")
        continue
      reason = implementations[name].unsupported_reason()
      if reason is None:
        logger.debug("%s: %s=None -> %r%s", op, argument, name, f" (skipped {'; '.join(skipped)})" if skipped else "")
        return name
      skipped.append(f"{name}: {reason}")
    raise ValueError(f"{op}: no implementation can run these inputs ({'; '.join(skipped)})")
  if requested not in implementations:
    raise ValueError(f"{op}: unknown {argument} {requested!r}; choose one of {names} or None")
  reason = implementations[requested].unsupported_reason()
  if reason is not None:
    alternatives = [name for name in names if name != requested]
    raise ValueError(
      f"{op}: {argument}={requested!r} cannot run: {reason}. Alternatives: {alternatives}, "
      "or None to pick the first that can run"
    )
  return requested
