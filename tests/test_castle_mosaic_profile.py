"""The CASTLE Mosaic kernels' profiling hooks (`pallas_kernels.castle.mosaic_profile`).

The profiler runs only on a GPU (its trace is written by a host callback, which cannot be
lowered for CUDA on a CPU machine); here: the compiler parameters inside and outside
`recording`, the trace summary on a trace laid out the way Mosaic GPU writes one, and
that `benchmarks/castle_mosaic_profile.py` traces each kernel with the phases it reports.
"""

import json

import jax
from jax.extend import core
import jax.numpy as jnp
import pytest

from pallas_kernels.castle import mosaic_profile
from pallas_kernels.castle.mosaic_config import CastleMosaicConfig
from benchmarks import castle_mosaic_profile
from benchmarks.castle_mosaic_swl_kernels import KernelInputs


def test_recording_turns_the_profiler_on_for_its_block_only(tmp_path):
  assert mosaic_profile.compiler_params().profile_space == 0
  with mosaic_profile.recording(str(tmp_path / "traces"), ranges_per_warpgroup=32):
    params = mosaic_profile.compiler_params()
    assert (params.profile_space, params.profile_dir, params.approx_math) == (32, str(tmp_path / "traces"), True)
  assert (tmp_path / "traces").is_dir()
  assert mosaic_profile.compiler_params().profile_space == 0, "recording leaked past its block"


def _event(name, begin, ts, tid):
  return {"name": name, "ph": "B" if begin else "E", "ts": ts, "pid": 1, "tid": tid}


def test_phase_table_sums_cycles_per_warpgroup_and_region(tmp_path):
  # Two programs of two warpgroups (tids 1, 2 and 3, 4); times in microseconds as the
  # trace writes them (ns / 1e3), so 1.0 is 1,000 cycles.
  events = [
    _event("scores", True, 0.0, 1),
    _event("scores", False, 3.0, 1),
    _event("dD", True, 3.0, 1),
    _event("dD", False, 4.0, 1),
    _event("dV^C", True, 0.0, 2),
    _event("dV^C", False, 2.0, 2),
    _event("scores", True, 10.0, 3),
    _event("scores", False, 15.0, 3),
    _event("dV^C", True, 10.0, 4),
    _event("dV^C", False, 14.0, 4),
  ]
  trace = tmp_path / "kernel-1-trace.json"
  trace.write_text(json.dumps({"displayTimeUnit": "ns", "traceEvents": events}))
  durations, spans = mosaic_profile.phase_durations(str(trace), warpgroups_per_program=2)
  assert durations[(0, "scores")] == pytest.approx([3000.0, 5000.0])
  assert durations[(0, "dD")] == pytest.approx([1000.0])
  assert durations[(1, "dV^C")] == pytest.approx([2000.0, 4000.0])
  assert spans == pytest.approx({0: 9000.0, 1: 6000.0})
  table = mosaic_profile.phase_table(str(trace), warpgroups_per_program=2)
  assert "| 0 | scores | 2 | 4000 | 4000 | 88.9% |" in table
  assert mosaic_profile.latest_trace(str(tmp_path), containing="dV^C") == str(trace)
  with pytest.raises(FileNotFoundError, match="containing 'walk'"):
    mosaic_profile.latest_trace(str(tmp_path), containing="walk")


def test_recording_rejects_a_useless_buffer(tmp_path):
  with pytest.raises(ValueError, match="ranges_per_warpgroup must be positive"):
    with mosaic_profile.recording(str(tmp_path), ranges_per_warpgroup=0):
      pass


@pytest.mark.parametrize("kernel", ["key_major_sweep", "key_side", "query_grads"])
def test_profile_benchmark_traces_each_kernel_with_its_phases(kernel):
  """The benchmark's kernel calls trace (kernel bodies included) and carry the phase names
  its trace selection looks for."""
  heads, seq, window = 1, 256, 64
  rows = lambda dtype=jnp.bfloat16: jnp.zeros((heads, seq, 128), dtype)
  data = KernelInputs(
    inputs=tuple(rows() for _ in range(6)),
    d_out=rows(),
    shift=jnp.zeros((heads, seq)),
    in_block_t=jnp.zeros((heads, seq, 64)),
    lookahead_keys=rows(jnp.float32),
    lse=jnp.zeros((heads, seq)),
    delta=jnp.zeros((heads, seq)),
    scale=128**-0.5,
  )
  call = castle_mosaic_profile.kernel_call(kernel, data, window, CastleMosaicConfig())
  phases = _name_stacks(jax.make_jaxpr(call)(*data.inputs).jaxpr, set())
  _, prefix = castle_mosaic_profile.KERNELS[kernel]
  prefix = prefix or "past window: "
  assert len([name for name in phases if name.startswith(prefix)]) >= 5, sorted(phases)


def _name_stacks(jaxpr, found):
  """Every equation's name stack in `jaxpr` and the jaxprs nested in its equations."""
  for eqn in jaxpr.eqns:
    found.add(str(eqn.source_info.name_stack))
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, core.ClosedJaxpr):
          _name_stacks(sub.jaxpr, found)
        elif isinstance(sub, core.Jaxpr):
          _name_stacks(sub, found)
  return found
