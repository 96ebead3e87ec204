"""In-context-learning curves: loss vs position in context of trained checkpoints.

    python -m benchmarks.icl_curve --workdirs=runs/icl_power,runs/icl_mha,runs/icl_swa \
        [--seq_len=4096] [--max_docs=64] [--output=DIR/icl_curve]

Each workdir is a `python -m train` run (config.json + checkpoints). The evaluation
text is document-aligned: the first seq_len + 1 tokens ([BOS] + document) of every
document of the eval split that has that many, so position t has exactly t tokens of
its own document as context (the training pipeline packs documents, which would mix
contexts). Per-position mean NLL is binned with exponentially growing bins (equal
width on a log axis, as the paper's Appendix D does) and written to
`<output>.json` (raw per-position losses and bins) and `<output>.csv` (bins);
`<output>.png` is plotted when matplotlib is installed (`pip install -e .[plot]`).
Default output: a new folder under ~/.cache/castle_jax/icl_curve/; a named --output whose
files exist is refused (to refresh docs/icl_curve.*, move those away first).
"""

from __future__ import annotations

import csv
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import flags, logging

from castle_jax.checkpoints import CheckpointError
from castle_jax.command_line import UsageError, run_absl
from castle_jax.data.pipeline import get_data_source
from castle_jax.outputs import fresh_directory, refuse_existing, user_cache_dir
from castle_jax.workdir import load_trained_model

_WORKDIRS = flags.DEFINE_list("workdirs", None, "Training workdirs to compare.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", None, "Context length (default: each run's data.seq_len).", lower_bound=2)
_MAX_DOCS = flags.DEFINE_integer("max_docs", 64, "Evaluate at most this many documents.", lower_bound=1)
_SPLIT = flags.DEFINE_string("split", None, "Split to read (default: each run's data.eval_split).")
_BINS_PER_OCTAVE = flags.DEFINE_integer("bins_per_octave", 2, "Bins per doubling of the position.", lower_bound=1)
_OUTPUT = flags.DEFINE_string(
  "output", None, "Output path without extension (default: a new folder in the user cache); must not exist yet."
)


def document_windows(data_config, tokenizer, seq_len: int, max_docs: int, split: str) -> np.ndarray:
  """int32 [docs, seq_len + 1]: the first seq_len + 1 tokens of each long-enough document."""
  source = get_data_source(data_config.dataset, split, data_config.data_dir, data_config.source_dir)
  windows = []
  for index in range(len(source)):
    text = source[index][data_config.text_key]
    text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
    tokens = np.concatenate([[tokenizer.bos_id], tokenizer.encode(text)])
    if len(tokens) >= seq_len + 1:
      windows.append(tokens[: seq_len + 1])
    if len(windows) == max_docs:
      break
  if not windows:
    raise UsageError(f"--seq_len={seq_len}: no document of split {split!r} has {seq_len + 1} tokens; lower it")
  return np.stack(windows).astype(np.int32)


def per_position_loss(model, params, windows: np.ndarray, batch_size: int = 1) -> np.ndarray:
  """float64 [seq_len]: mean NLL (nats) of predicting token t + 1 from tokens 0..t."""

  @jax.jit
  def nll(tokens):
    logits, _ = model.apply({"params": params}, tokens[:, :-1])
    targets = tokens[:, 1:]
    return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]

  total = np.zeros(windows.shape[1] - 1)
  for start in range(0, len(windows), batch_size):
    total += np.asarray(nll(windows[start : start + batch_size]), np.float64).sum(0)
  return total / len(windows)


def log_bins(length: int, per_octave: int) -> list[tuple[int, int]]:
  """[(start, stop)) position bins whose widths grow geometrically, covering 0..length-1."""
  edges = sorted(
    {0, length} | {int(round(2 ** (i / per_octave))) for i in range(int(np.log2(length) * per_octave) + 1)}
  )
  return [(a, b) for a, b in zip(edges[:-1], edges[1:]) if a < length]


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  if not _WORKDIRS.value:
    raise UsageError("--workdirs is required: the training workdirs to compare, e.g. --workdirs=runs/a,runs/b")
  if _OUTPUT.value:
    output = _OUTPUT.value
    refuse_existing(f"--output={output}", *(output + suffix for suffix in (".json", ".csv", ".png")))
  else:
    output = os.path.join(fresh_directory(user_cache_dir("icl_curve")), "icl_curve")
  results = {}
  for workdir in _WORKDIRS.value:
    try:
      model, params, tokenizer, step = load_trained_model(workdir)
    except (FileNotFoundError, ValueError, CheckpointError) as e:
      raise UsageError(f"--workdirs: {e}") from e
    with open(os.path.join(workdir, "config.json")) as f:
      config = json.load(f)
    data = config["data"]
    seq_len = _SEQ_LEN.value or data["seq_len"]
    data_config = ml_collections.ConfigDict(data)
    windows = document_windows(data_config, tokenizer, seq_len, _MAX_DOCS.value, _SPLIT.value or data["eval_split"])
    losses = per_position_loss(model, params, windows)
    name = os.path.basename(os.path.normpath(workdir))
    model_config = config["model"]
    results[name] = {
      "workdir": workdir,
      "step": step,
      "documents": len(windows),
      "seq_len": seq_len,
      "attention": model_config["attention"],
      "sliding_window": model_config["sliding_window"],
      "attention_kwargs": model_config.get("attention_kwargs", {}),
      "loss": [round(x, 5) for x in losses.tolist()],
    }
    print(
      f"{name}: step {step}, {len(windows)} documents x {seq_len} tokens, mean loss {losses.mean():.4f}, "
      f"last quarter {losses[3 * seq_len // 4 :].mean():.4f}",
      flush=True,
    )

  seq_len = min(len(r["loss"]) for r in results.values())
  bins = log_bins(seq_len, _BINS_PER_OCTAVE.value)
  for result in results.values():
    loss = np.asarray(result["loss"])
    result["binned_loss"] = [float(loss[a:b].mean()) for a, b in bins]
  os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
  with open(output + ".json", "w") as f:
    json.dump({"bins": bins, "runs": results}, f)
  with open(output + ".csv", "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["bin_start", "bin_stop", *results])
    for i, (a, b) in enumerate(bins):
      writer.writerow([a, b, *(f"{r['binned_loss'][i]:.5f}" for r in results.values())])
  print(f"wrote {output}.json and {output}.csv")
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not installed (pip install -e .[plot]); skipped the plot")
    return
  figure, axis = plt.subplots(figsize=(6, 4))
  centers = [np.sqrt(max(a, 1) * b) for a, b in bins]
  for name, result in results.items():
    axis.plot(centers, result["binned_loss"], marker="o", markersize=3, label=name)
  axis.set_xscale("log")
  axis.set_xlabel("position in context (tokens)")
  axis.set_ylabel("loss (nats / token)")
  axis.set_title("In-context learning curves")
  axis.grid(True, which="both", alpha=0.3)
  axis.legend()
  figure.tight_layout()
  figure.savefig(output + ".png", dpi=120)
  print(f"wrote {output}.png")


if __name__ == "__main__":
  run_absl(main)
