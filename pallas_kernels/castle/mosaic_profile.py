"""Per-phase timelines of the CASTLE Mosaic GPU kernels, from Mosaic GPU's on-device profiler.

The kernels mark their phases with `jax.named_scope` (e.g. "lookahead: scores",
"key side: score products"). Under `recording(directory)` every kernel traced inside the
block is compiled with the profiler on: thread 0 of each warpgroup writes a (name, SM
clock) pair at the start and end of each named region into shared memory, and the host
writes one Perfetto/Chrome trace per call into `directory` (`*-trace.json`).
`phase_table` turns such a trace into per-phase cycle counts.

    with mosaic_profile.recording("/tmp/traces", ranges_per_warpgroup=24):
      jax.block_until_ready(jax.jit(kernel_call)(*inputs))
    print(mosaic_profile.phase_table(mosaic_profile.latest_trace("/tmp/traces"), warpgroups_per_program=2))

The event buffer takes 16 bytes per range per warpgroup of shared memory on top of the
kernel's own (the key-major backward at head dim 128 leaves ~1 KB: 24 ranges per
warpgroup for its two warpgroups; 32 did not fit on the H100). With bounds checking on, a
warpgroup's ranges past the buffer are dropped, so a trace covers the first steps of each
program's sweep. Times are SM clock cycles (1,000 cycles = 0.5 us at 2 GHz); the regions
end where the kernel waits for its asynchronous work, so a wgmma's time shows up in the
region that waits on it.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import json
import os
import statistics

import jax.experimental.pallas.mosaic_gpu as plgpu

_recording: dict = {}


@contextlib.contextmanager
def recording(directory: str, ranges_per_warpgroup: int = 24):
  """Compile the CASTLE Mosaic kernels traced in this block with the on-device profiler.

  Args:
    directory: where each kernel call writes its trace (created if missing).
    ranges_per_warpgroup: named ranges kept per warpgroup and program (16 bytes each of
      shared memory per warpgroup).
  """
  if ranges_per_warpgroup < 1:
    raise ValueError(f"ranges_per_warpgroup must be positive, got {ranges_per_warpgroup}")
  os.makedirs(directory, exist_ok=True)
  previous = dict(_recording)
  _recording.update(directory=directory, ranges=ranges_per_warpgroup)
  try:
    yield
  finally:
    _recording.clear()
    _recording.update(previous)


def compiler_params(*, warp_local_reductions: bool = False) -> plgpu.CompilerParams:
  """The CASTLE kernels' compiler parameters: fast approximate exp/sigmoid, and the
  profiler when inside `recording`.

  Mosaic GPU sets aside 2 KB of shared memory for a kernel with any reduction, in case
  one crosses warps. `warp_local_reductions` (every reduction stays inside a warp, e.g.
  row sums of a WGMMA tile over its columns) gives that back; a reduction that would need
  it then fails to lower.
  """
  extra = dict(reduction_scratch_bytes=0) if warp_local_reductions else {}
  if not _recording:
    return plgpu.CompilerParams(approx_math=True, **extra)
  return plgpu.CompilerParams(
    approx_math=True,
    profile_space=_recording["ranges"],
    profile_dir=_recording["directory"],
    profile_bounds_check=True,
    **extra,
  )


def latest_trace(directory: str, containing: str | None = None) -> str:
  """The newest `*-trace.json` in `directory` (whose text contains `containing`, if given)."""
  traces = sorted(glob.glob(os.path.join(directory, "*-trace.json")), key=os.path.getmtime, reverse=True)
  for trace in traces:
    if containing is None:
      return trace
    with open(trace) as f:
      if containing in f.read():
        return trace
  raise FileNotFoundError(
    f"no *-trace.json{'' if containing is None else ' containing ' + repr(containing)} in "
    f"{directory}; did a kernel with named regions run inside `recording`?"
  )


def phase_durations(trace_path: str, warpgroups_per_program: int):
  """Cycles of each named region in one trace, and each warpgroup's recorded span.

  Args:
    trace_path: a trace written under `recording`.
    warpgroups_per_program: the kernel's warpgroups (`num_threads`); the trace numbers
      its threads 1 + warpgroup + warpgroups_per_program * program.

  Returns:
    ({(warpgroup, region name): [cycles of each occurrence]},
     {warpgroup: cycles from the first range's start to the last range's end, summed over
      programs}). Regions are expected not to nest.
  """
  with open(trace_path) as f:
    events = json.load(f)["traceEvents"]
  durations = collections.defaultdict(list)
  spans = collections.Counter()
  open_ranges = {}
  first_last = {}
  for event in events:
    key = (event["tid"], event["name"])
    # Trace times are (global ns + SM cycles) / 1e3; within a program only the cycles change.
    cycles = event["ts"] * 1e3
    first, _ = first_last.get(event["tid"], (cycles, cycles))
    first_last[event["tid"]] = (first, cycles)
    if event["ph"] == "B":
      open_ranges[key] = cycles
    elif key in open_ranges:
      durations[((event["tid"] - 1) % warpgroups_per_program, event["name"])].append(cycles - open_ranges.pop(key))
  for tid, (first, last) in first_last.items():
    spans[(tid - 1) % warpgroups_per_program] += last - first
  return dict(durations), dict(spans)


def phase_table(trace_path: str, warpgroups_per_program: int) -> str:
  """A markdown table: per (warpgroup, region), occurrences, median and mean cycles, and
  the region's share of its warpgroup's recorded span (what no region covers is listed as
  "(between regions)")."""
  durations, spans = phase_durations(trace_path, warpgroups_per_program)
  covered = collections.Counter()
  for (warpgroup, _), values in durations.items():
    covered[warpgroup] += sum(values)
  lines = [
    "| warpgroup | region | count | median cycles | mean cycles | share |",
    "| --- | --- | --- | --- | --- | --- |",
  ]
  for (warpgroup, name), values in sorted(durations.items(), key=lambda kv: (kv[0][0], -sum(kv[1]))):
    lines.append(
      f"| {warpgroup} | {name} | {len(values)} | {statistics.median(values):.0f} | "
      f"{statistics.fmean(values):.0f} | {sum(values) / spans[warpgroup]:.1%} |"
    )
  for warpgroup, span in sorted(spans.items()):
    lines.append(f"| {warpgroup} | (between regions) | | | | {1 - covered[warpgroup] / span:.1%} |")
  return "\n".join(lines)
