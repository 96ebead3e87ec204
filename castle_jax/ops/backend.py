"""How every op picks its implementation: one pattern, one vocabulary, one logger.

An op declares its implementations in a table (name -> `Implementation`), each with an
`unsupported_reason()` for the call at hand (None: it can run; else why not, naming the
argument and the fix), the kernel config type it takes (`config_type`), and a default
order, fastest first. The names are the same for every op: "reference" (the plain-jnp
oracle), "xla", and the kernels by backend, "triton" (Pallas Triton, any CUDA GPU) and
"mosaic" (Pallas Mosaic GPU, Hopper), plus "cudnn" where it applies. Then `choose(...)`:
  - implementation=None: walks the default order and takes the first implementation that
    can run (and takes the given `kernel_config`'s type, if any), logging the choice and
    why the others before it were skipped at debug level on the "castle_jax.ops.backend"
    logger; an implementation that could run but that the default passes over
    (`default_declines`: e.g. not measured faster for these inputs) is logged at INFO,
    once per distinct reason;
  - an explicit name that cannot run: ValueError naming the argument, the reason and the
    alternatives (only the default falls back);
  - a kernel config of the wrong type for the implementation: ValueError naming the type
    it takes;
  - an unknown name: ValueError listing the known ones ("pallas", the name before the
    kernels were named by backend, says what it is now).
Each `unsupported_reason` runs at most once per call.

An implementation can be restricted to some backends for the default choice only
(`default_backends`): the Pallas kernels run anywhere when asked for (interpret mode
on CPU, for tests) but are the default only on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable, Mapping, Sequence

import jax

logger = logging.getLogger(__name__)

# The Pallas kernels' implementation names, by backend.
KERNEL_IMPLEMENTATIONS = ("triton", "mosaic")
# Keyword arguments that were renamed when the kernels got their backends' names.
RENAMED_ARGUMENTS = {"pallas_config": "kernel_config", "decode_pallas_config": "decode_kernel_config"}


def _always_supported() -> str | None:
  return None


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One way an op can run.

  Attributes:
    unsupported_reason: () -> None when it can run these inputs, else a message.
    default_backends: jax backends on which the default choice may take it (None: all).
    config_type: the kernel config class it takes as `kernel_config` (None: it takes none).
    default_declines: () -> None, or why the default passes over it even though it can
      run (an explicit choice still runs it).
  """

  unsupported_reason: Callable[[], str | None] = _always_supported
  default_backends: tuple[str, ...] | None = None
  config_type: type | None = None
  default_declines: Callable[[], str | None] = _always_supported


class LogOnce:
  """Logs each distinct message once, at INFO on `logger` (a choice made at every trace
  would otherwise repeat itself). `cache_clear()` forgets the messages seen."""

  def __init__(self, logger: logging.Logger):
    self.logger = logger
    self._seen: set[str] = set()

  def __call__(self, message: str) -> None:
    if message not in self._seen:
      self._seen.add(message)
      self.logger.info(message)

  def cache_clear(self) -> None:
    self._seen.clear()


log_once = LogOnce(logger)


def pallas_is_renamed(op: str, names: Sequence[str], argument: str = "implementation") -> str:
  """The message for the old name "pallas": which kernel implementations `names` has now."""
  kernels = " or ".join(repr(name) for name in KERNEL_IMPLEMENTATIONS if name in names)
  if not kernels:
    return f"{op}: {argument}='pallas' is gone (the kernels are 'triton' and 'mosaic'); choose one of {tuple(names)}"
  return f"{op}: {argument}='pallas' is now {kernels} (None picks the fastest that runs here)"


def rejects_renamed_arguments(function):
  """Wraps a public op so that a renamed keyword (`RENAMED_ARGUMENTS`) fails with one line
  naming the new one, instead of Python's "unexpected keyword argument"."""

  @functools.wraps(function)
  def wrapper(*args, **kwargs):
    for old, new in RENAMED_ARGUMENTS.items():
      if old in kwargs:
        raise ValueError(
          f"{function.__name__}: {old}= is now {new}= (the config type of the implementation that runs, "
          "e.g. CastleTritonConfig for implementation='triton')"
        )
    return function(*args, **kwargs)

  return wrapper


def _check_config_type(op, name, implementation, kernel_config, argument, config_argument):
  if kernel_config is None or type(kernel_config) is implementation.config_type:
    return
  if implementation.config_type is None:
    raise ValueError(
      f"{op}: {argument}={name!r} takes no {config_argument}, got a {type(kernel_config).__name__}; "
      "pass kernel_config=None or pick the implementation it configures"
    )
  raise ValueError(
    f"{op}: {config_argument} for {argument}={name!r} must be a {implementation.config_type.__name__} "
    f"(or None), got a {type(kernel_config).__name__}"
  )


def choose(
  op: str,
  requested: str | None,
  implementations: Mapping[str, Implementation],
  default_order: Sequence[str],
  *,
  argument: str = "implementation",
  kernel_config=None,
  config_argument: str = "kernel_config",
) -> str:
  """The implementation to run (see the module docstring).

  Args:
    op: the op's name, for messages and the log.
    requested: the caller's choice, or None for the default.
    implementations: every implementation the op accepts, by name.
    default_order: the names the default tries, fastest first; the last one should
      always be supported.
    argument: the argument's name in messages (e.g. "model.attention_impl" callers
      pass "implementation").
    kernel_config: the caller's kernel config, or None. With a default choice, only
      implementations that take its type (or no config at all) are candidates.
    config_argument: the kernel config argument's name in messages.

  Raises:
    ValueError: an unknown name, an explicit choice that cannot run, or a kernel config
      that no implementation (or not the requested one) takes.
  """
  names = tuple(implementations)
  if requested == "pallas":
    raise ValueError(pallas_is_renamed(op, names, argument))
  if kernel_config is not None:
    accepted = {impl.config_type for impl in implementations.values() if impl.config_type is not None}
    if type(kernel_config) not in accepted:
      raise ValueError(
        f"{op}: {config_argument} must be one of {sorted(t.__name__ for t in accepted)} (or None), "
        f"got {kernel_config!r}"
      )
  if requested is None:
    skipped = []
    for name in default_order:
      implementation = implementations[name]
      backends = implementation.default_backends
      if backends is not None and jax.default_backend() not in backends:
        skipped.append(f"{name}: not a default on backend {jax.default_backend()!r}")
        continue
      if kernel_config is not None and implementation.config_type not in (None, type(kernel_config)):
        skipped.append(f"{name}: {config_argument} is a {type(kernel_config).__name__}")
        continue
      reason = implementation.unsupported_reason()
      if reason is None:
        declined = implementation.default_declines()
        if declined is not None:
          log_once(f"{op}: {argument}=None passes over {name!r}: {declined}")
          reason = declined
      if reason is None:
        logger.debug("%s: %s=None -> %r%s", op, argument, name, f" (skipped {'; '.join(skipped)})" if skipped else "")
        return name
      skipped.append(f"{name}: {reason}")
    raise ValueError(f"{op}: no implementation can run these inputs ({'; '.join(skipped)})")
  if requested not in implementations:
    raise ValueError(f"{op}: unknown {argument} {requested!r}; choose one of {names} or None")
  _check_config_type(op, requested, implementations[requested], kernel_config, argument, config_argument)
  reason = implementations[requested].unsupported_reason()
  if reason is not None:
    alternatives = [name for name in names if name != requested]
    raise ValueError(
      f"{op}: {argument}={requested!r} cannot run: {reason}. Alternatives: {alternatives}, "
      "or None to pick the first that can run"
    )
  return requested
