"""A/B of the Mosaic kernels' sigmoid: IEEE division vs rsqrt^2 (same process), and their outputs' difference."""
import sys, time
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp
from castle_mosaic_swl_kernels import kernel_inputs, past_window_pairs, HEAD_DIM
from timing import median_ms
from pallas_kernels.castle import mosaic_forward, mosaic_past_window, mosaic_past_window_backward, mosaic_math

rsqrt_sigmoid = mosaic_math.sigmoid
divide_sigmoid = lambda x: 1.0 / (1.0 + jnp.exp(-x))
heads, seq, window = 18, 16384, 512
t0 = time.time()
data = kernel_inputs(heads, seq, window)
print(f"inputs {time.time() - t0:.0f}s", flush=True)
past = dict(scale=data.scale, window=window, block_q=64, block_k=64, keys_per_program=128, interpret=None)
rows = jax.ShapeDtypeStruct((heads, seq, HEAD_DIM), jnp.float32)
sums_type = jax.ShapeDtypeStruct((heads, seq), jnp.float32)
k = data.lookahead_keys

def query_major():
  return jax.jit(lambda *a: mosaic_forward.run_on_zeroed_refs(
      lambda acc_ref, sums_ref: mosaic_past_window.accumulate_past_window(
          a[3].astype(jnp.float16), a[4].astype(jnp.float16), k, a[5], data.shift, acc_ref, sums_ref, **past),
      (rows, sums_type)))

def query_grads():
  return jax.jit(lambda *a: mosaic_forward.run_on_zeroed_refs(
      lambda dq_ref: mosaic_past_window_backward.accumulate_query_grads(
          a[3], a[4], k, a[5], data.d_out, data.lse, data.delta, dq_ref, **past), (rows,)))

product = 2 * past_window_pairs(heads, seq, window) * HEAD_DIM
for name, make, flops in (("fwd query-major", query_major, 3 * product), ("bwd dQ^C", query_grads, 5 * product)):
  outs = {}
  for variant, fn in (("divide", divide_sigmoid), ("rsqrt", rsqrt_sigmoid)):
    mosaic_math.sigmoid = fn
    t0 = time.time()
    f = make()
    outs[variant] = jax.block_until_ready(f(*data.inputs))
    ms = median_ms(f, [data.inputs], 5)
    print(f"RESULT {name} {variant}: {ms:.2f} ms, {flops / ms / 1e9:.0f} TFLOP/s (compile+run {time.time() - t0:.0f}s)", flush=True)
  for a, b in zip(jax.tree.leaves(outs["divide"]), jax.tree.leaves(outs["rsqrt"])):
    rel = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
    print(f"RESULT {name} max |rsqrt - divide| / max |divide| = {rel:.2e}", flush=True)
