"""Do a trained model's gradients agree across attention implementations?

    python -m benchmarks.gradient_agreement --workdir=runs/castle_swl_s/seed_0 [--step=N] \
        [--implementations=xla,triton,mosaic] [--batch=4] [--dtype=bfloat16] [--output=DIR or FILE.json]

Random inputs (the op tests) and a trained model's activations (peaked attention, grown value
norms) exercise a kernel differently. This loads a checkpoint, takes `--batch` sequences of the
run's validation text at its training length, and computes the loss gradient of every weight
matrix three ways: the float32 model on the XLA path at full matmul precision (the reference),
then the model in its training dtype (or `--dtype`) with each of `--implementations`. Per implementation it
prints the loss and the relative error of each weight's gradient against the reference
(||g - g_ref|| / ||g_ref||: max, median and the worst weights); an implementation with no
defect lands near the others (bf16: ~1e-2), so run the XLA path beside a kernel as its control.

Writes `<output>/gradient_agreement_step<N>.json` (default output: <workdir>/eval/) with every
weight's error per implementation.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from castle_jax import outputs
from castle_jax.eval import cli
from castle_jax.layers.registry import get_attention
from castle_jax.models import ModelConfig, build_model

NAME = "gradient_agreement"
REFERENCE = "xla"


def weight_gradients(
  model_config: ModelConfig, params: Any, inputs: jax.Array, targets: jax.Array
) -> tuple[float, dict[str, np.ndarray]]:
  """(mean next-token loss, {weight path: float64 gradient}) of the model `model_config` builds."""
  model = build_model(model_config)

  def loss_fn(p):
    logits, _ = model.apply({"params": p}, inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()

  precision = "highest" if model_config.dtype == "float32" else "default"
  with jax.default_matmul_precision(precision):
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
  leaves = jax.tree_util.tree_leaves_with_path(grads)
  return float(loss), {short_name(jax.tree_util.keystr(path)): np.asarray(g, np.float64) for path, g in leaves}


def short_name(path: str) -> str:
  """ "['block_1']['attention']['key']['kernel']" -> "block_1.attention.key"."""
  return path.strip("[']").replace("']['", ".").removesuffix(".kernel")


def relative_errors(grads: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> dict[str, float]:
  """||g - g_ref|| / ||g_ref|| per weight (inf where g is not finite)."""
  out = {}
  for name, ref in reference.items():
    g = grads[name]
    out[name] = (
      float(np.linalg.norm(g - ref) / max(np.linalg.norm(ref), 1e-30)) if np.isfinite(g).all() else float("inf")
    )
  return out


def main(argv: Sequence[str] | None = None) -> None:
  parser = cli.make_parser(f"python -m benchmarks.{NAME}", __doc__.split("\n\n")[0], lengths=None)
  parser.add_argument(
    "--implementations",
    default=None,
    help="comma-separated attention implementations (default: every one of the model's attention)",
  )
  parser.add_argument(
    "--dtype",
    default=None,
    choices=("float32", "bfloat16", "float16"),
    help="activations' dtype of the compared runs (default: the model's training dtype)",
  )
  parser.add_argument("--batch", type=int, default=2, help="validation sequences of the training length (default 2)")
  args = parser.parse_args(argv)
  cli.require(args.batch >= 1, "--batch", "at least 1", args.batch)
  cli.check_output(args)
  (_, params, tokenizer, step), config = cli.load(args)
  model_config = ModelConfig.from_mapping(config.model)
  if args.dtype:
    model_config = dataclasses.replace(model_config, dtype=args.dtype)
  known = get_attention(model_config.attention).implementations
  names = args.implementations.split(",") if args.implementations else list(known)
  for name in names:
    cli.require(
      name in known,
      "--implementations",
      f"implementations of attention {model_config.attention!r}: {', '.join(known)}",
      name,
    )
  seq = config.data.seq_len
  tokens = cli.validation_tokens(config, tokenizer, args.batch * (seq + 1))
  cli.require(
    tokens.size == args.batch * (seq + 1),
    "--batch",
    f"at most {tokens.size // (seq + 1)} (the validation text's length)",
    args.batch,
  )
  tokens = jnp.asarray(tokens.reshape(args.batch, seq + 1))
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  reference_loss, reference = weight_gradients(
    dataclasses.replace(model_config, attention_impl=REFERENCE, dtype="float32"), params, inputs, targets
  )
  rows, record = (
    [],
    {
      "reference": {"implementation": REFERENCE, "dtype": "float32", "loss": reference_loss},
      "batch": args.batch,
      "seq_len": seq,
      "implementations": {},
    },
  )
  for name in names:
    start = time.time()
    loss, grads = weight_gradients(dataclasses.replace(model_config, attention_impl=name), params, inputs, targets)
    errors = relative_errors(grads, reference)
    worst = sorted(errors, key=errors.get, reverse=True)[:3]
    record["implementations"][name] = {"loss": loss, "dtype": model_config.dtype, "errors": errors}
    rows.append(
      [
        name,
        f"{loss:.5f}",
        f"{max(errors.values()):.3g}",
        f"{np.median(list(errors.values())):.3g}",
        "; ".join(f"{w} {errors[w]:.2g}" for w in worst),
        f"{time.time() - start:.0f}",
      ]
    )
  print(
    f"reference: float32 on {REFERENCE}, loss {reference_loss:.5f}; {args.batch} x {seq} validation tokens, step {step}"
  )
  print(cli.format_table(["implementation", "loss", "max error", "median", "worst weights", "s"], rows))
  stem = cli.output_stem(args.output, cli.default_output_dir(args), NAME, step)
  path = outputs.publish(lambda p: cli.write_json(p, {**cli.header(NAME, args, config, step), **record}), stem, ".json")
  print(f"wrote {path}.json")


if __name__ == "__main__":
  raise SystemExit(cli.run_main(main, None))
