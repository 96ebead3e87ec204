"""The test suite's own guards (tests/conftest.py): jax's compiled programs are released
before the process runs out of memory mappings."""

import jax
import pytest

import conftest


def test_the_maps_of_this_process_and_the_kernels_limit_are_read():
  count, limit = conftest.memory_map_count(), conftest.memory_map_limit()
  if count is None or limit is None:
    pytest.skip("no /proc/self/maps or vm.max_map_count (not Linux)")
  assert 0 < count < limit


@pytest.mark.parametrize("mappings, cleared", [(499, False), (500, False), (501, True), (None, False)])
def test_caches_are_cleared_only_past_half_the_limit(monkeypatch, mappings, cleared):
  calls = []
  monkeypatch.setattr(jax, "clear_caches", lambda: calls.append(True))
  released = conftest.release_compiled_programs_near_the_map_limit(count=lambda: mappings, limit=lambda: 1000)
  assert released is cleared and calls == ([True] if cleared else [])


def test_clearing_releases_the_mappings_of_compiled_programs():
  count = conftest.memory_map_count()
  if count is None:
    pytest.skip("no /proc/self/maps (not Linux)")
  jax.clear_caches()
  before = conftest.memory_map_count()
  for i in range(40):  # distinct programs, each compiled and kept by jax's caches
    jax.jit(lambda x, i=i: jax.numpy.tanh(x * (i + 1)) @ x)(jax.numpy.ones((4 + i, 4 + i))).block_until_ready()
  held = conftest.memory_map_count()
  assert conftest.release_compiled_programs_near_the_map_limit(count=lambda: held, limit=lambda: 0)
  assert conftest.memory_map_count() < held, (before, held)
