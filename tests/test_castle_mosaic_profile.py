"""The CASTLE Mosaic kernels' profiling hooks (`pallas_kernels.castle.mosaic_profile`).

The profiler runs only on a GPU (its trace is written by a host callback, which cannot be
lowered for CUDA on a CPU machine); here: the compiler parameters inside and outside
`recording`, and the trace summary on a trace laid out the way Mosaic GPU writes one.
"""

import json

import pytest

from pallas_kernels.castle import mosaic_profile


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
      _event("scores", True, 0.0, 1), _event("scores", False, 3.0, 1),
      _event("dD", True, 3.0, 1), _event("dD", False, 4.0, 1),
      _event("dV^C", True, 0.0, 2), _event("dV^C", False, 2.0, 2),
      _event("scores", True, 10.0, 3), _event("scores", False, 15.0, 3),
      _event("dV^C", True, 10.0, 4), _event("dV^C", False, 14.0, 4),
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
