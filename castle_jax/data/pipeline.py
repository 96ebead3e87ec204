"""grain input pipelines for language modelling over a TFDS dataset.

data.task picks the stream (one dispatch, in make_lm_dataset): "lm" (below),
"passkey" (castle_jax.data.passkey_data: passkey-retrieval prompts over the same
corpus, generated on the fly, in the same batch format), or a mechanism task,
"variable_tracking" or "mqar" (castle_jax.data.task_data: synthetic prompts, no corpus).

source (random access) -> shuffle (train) -> repeat -> this process's shard ->
tokenize to [BOS] + doc + [EOS] -> concatenate and split into windows of
seq_len + 1 tokens -> batch -> {"inputs", "targets"} shifted by one token.
The iterator's position is a small state (get_state/set_state) that checkpoints
save, so a resumed run reads exactly the batches it would have read.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import functools
import signal
import hashlib
import os
import shutil
import tempfile
from typing import Any

import grain
from absl import flags as absl_flags
import jax
import numpy as np
import tensorflow_datasets as tfds

from castle_jax.data import python_stdlib
from castle_jax.data.passkey_data import make_passkey_dataset
from castle_jax.data.task_data import TASKS as MECHANISM_TASKS
from castle_jax.data.task_data import make_task_dataset
from castle_jax.data.tokenizer import Tokenizer

TASKS = ("lm", "passkey", *MECHANISM_TASKS)

DEFAULT_DATA_DIR = os.path.join(os.path.expanduser("~"), ".cache", "castle_jax", "tensorflow_datasets")


def resolve_data_dir(data_dir: str | None) -> str:
  """data.data_dir, else $CASTLE_JAX_DATA_DIR, else ~/.cache/castle_jax/tensorflow_datasets."""
  return data_dir or os.environ.get("CASTLE_JAX_DATA_DIR") or DEFAULT_DATA_DIR


def get_builder(dataset: str, data_dir: str | None = None, source_dir: str | None = None):
  """The TFDS builder of `dataset`, prepared (built once, then reused from data_dir).

  Args:
    dataset: "python_stdlib" (built locally from Python sources) or any TFDS name,
      optionally "name/config:version"; other datasets are prepared by TFDS itself.
    data_dir: where prepared datasets live (see resolve_data_dir).
    source_dir: for python_stdlib, a directory of .py files to use instead of the
      standard library.
  """
  data_dir = resolve_data_dir(data_dir)
  if dataset != "python_stdlib" and source_dir:
    raise ValueError(f"data.source_dir only applies to dataset 'python_stdlib', not {dataset!r}")
  # The builder is made inside the lock: one made before another process finished
  # the build would not see the splits that build wrote.
  with _one_preparer(data_dir):
    if dataset == "python_stdlib":
      # The built-in config is passed by name; TFDS rejects an equal-named new instance.
      config = python_stdlib.directory_config(source_dir) if source_dir else python_stdlib.stdlib_config().name
      builder = python_stdlib.PythonStdlib(config=config, data_dir=data_dir, file_format="array_record")
      _prepare_or_clean_up(builder, os.path.join(data_dir, "python_stdlib", builder.builder_config.name))
      return builder
    try:
      builder = tfds.builder(dataset, data_dir=data_dir, file_format="array_record")
    except tfds.core.registered.DatasetNotFoundError as e:
      raise ValueError(
        f"Unknown dataset {dataset!r} (config data.dataset). Use 'python_stdlib' (the embedded corpus) "
        "or the name of a TFDS dataset."
      ) from e
    builder.download_and_prepare()
    return builder


@contextlib.contextmanager
def _one_preparer(data_dir: str):
  """Holds an exclusive lock for data_dir on this machine: processes started together
  (several trainings, or test workers) on a fresh machine would otherwise build the same
  dataset at once, and one's failed build removes the folder another is writing. The
  lock file lives in the temp dir, so a failed build still leaves data_dir as it was."""
  key = hashlib.sha256(os.path.abspath(data_dir).encode()).hexdigest()[:16]
  with open(os.path.join(tempfile.gettempdir(), f"castle_jax_prepare_{key}.lock"), "a") as handle:
    fcntl.flock(handle, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(handle, fcntl.LOCK_UN)


def _prepare_or_clean_up(builder, cache_dir: str) -> None:
  """Builds the dataset; a failed build removes the folders that this attempt
  created and that hold nothing else (the config's cache folder, TFDS's
  bookkeeping), so no empty cache is left to be mistaken for a corpus."""
  dataset_dir = os.path.dirname(cache_dir)
  data_dir = os.path.dirname(dataset_dir)
  downloads = os.path.join(data_dir, "downloads")
  existed = {p: os.path.exists(p) for p in (cache_dir, dataset_dir, downloads, data_dir)}
  try:
    builder.download_and_prepare()
  except BaseException:

    def only(path, allowed):
      return all(name in allowed for name in os.listdir(path))

    if not existed[cache_dir]:
      shutil.rmtree(cache_dir, ignore_errors=True)
    if not existed[dataset_dir] and os.path.isdir(dataset_dir) and only(dataset_dir, {".config"}):
      shutil.rmtree(dataset_dir, ignore_errors=True)
    if (
      not existed[downloads]
      and os.path.isdir(downloads)
      and only(downloads, {"extracted"})
      and not any(
        os.scandir(os.path.join(downloads, "extracted")) if os.path.isdir(os.path.join(downloads, "extracted")) else ()
      )
    ):
      shutil.rmtree(downloads, ignore_errors=True)
    if not existed[data_dir] and os.path.isdir(data_dir) and not os.listdir(data_dir):
      os.rmdir(data_dir)
    raise


def get_data_source(dataset: str, split: str, data_dir: str | None = None, source_dir: str | None = None):
  """A random-access source of one split's examples (dicts of features)."""
  builder = get_builder(dataset, data_dir, source_dir)
  splits = sorted(builder.info.splits.keys())
  if split not in splits:
    raise ValueError(
      f"Dataset {dataset!r} has no split {split!r} (config data.train_split/eval_split); available: {splits}"
    )
  source = builder.as_data_source(split)
  if len(source) == 0:
    raise ValueError(f"Split {split!r} of dataset {dataset!r} is empty")
  return source


def _tokenize(example: dict[str, Any], *, tokenizer: Tokenizer, text_key: str) -> dict[str, np.ndarray]:
  text = example[text_key]
  if isinstance(text, bytes):
    text = text.decode("utf-8", errors="replace")
  tokens = np.concatenate([[tokenizer.bos_id], tokenizer.encode(text), [tokenizer.eos_id]])
  return {"tokens": tokens.astype(np.int32)}


def _to_inputs_and_targets(batch: dict[str, np.ndarray], *, pad_id: int) -> dict[str, np.ndarray]:
  # Segment id 0 marks packing padding (only in a finite stream's last window).
  window = np.where(batch["tokens_segment_ids"] > 0, batch["tokens"], pad_id)
  return {"inputs": window[:, :-1], "targets": window[:, 1:]}


def make_lm_dataset(
  data_config,
  tokenizer: Tokenizer,
  *,
  split: str,
  shuffle: bool,
  process_index: int | None = None,
  process_count: int | None = None,
  prefetch: int = 0,
  worker_threads: bool = False,
) -> grain.IterDataset:
  """The packed, batched dataset of one split, for this process.

  Args:
    data_config: `config.data` (task, dataset, data_dir, source_dir, text_key, seq_len,
      batch_size (global), shuffle_seed, worker_count; passkey.* for task "passkey",
      whose stream replaces the packed documents and ignores `shuffle`; <task>.* for
      the mechanism tasks, whose streams read no dataset and ignore `shuffle`).
    tokenizer: maps text to ids.
    split: TFDS split name.
    shuffle: shuffle documents (reshuffled every epoch); eval streams keep file order.
    process_index, process_count: this process's shard (default: from jax).
    prefetch: batches a background thread reads ahead (0: none). The iterator's
      state still records the position of the batches handed out, so a checkpoint
      resumes exactly where the consumer was.
    worker_threads: read the `worker_count` shards with threads of this process
      instead of worker processes: the same shards interleaved in the same order,
      so the same batches. For a few batches read from a fresh iterator (the
      evaluation), which would otherwise wait for new processes to start every
      time, and which a stop signal sent to the process group must not break.

  Yields:
    {"inputs": int32 [batch_size // process_count, seq_len],
     "targets": int32 [batch_size // process_count, seq_len]} forever (epochs repeat).
  """
  d = data_config
  process_index = jax.process_index() if process_index is None else process_index
  process_count = jax.process_count() if process_count is None else process_count
  if d.seq_len < 1:
    raise ValueError(f"data.seq_len must be >= 1, got {d.seq_len}")
  if d.batch_size < 1 or d.batch_size % process_count:
    raise ValueError(f"data.batch_size ({d.batch_size}) must be a positive multiple of the {process_count} processes")
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index {process_index} is outside [0, {process_count})")
  task = d.get("task", "lm")
  if task not in TASKS:
    raise ValueError(f"data.task must be one of {TASKS}, got {task!r}")
  threads = worker_threads and d.worker_count > 0
  # The worker threads read their shards one batch ahead; grain's default read-ahead (16
  # threads, 500 elements per shard) would make them compete with the reader for the GIL.
  read_options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0) if threads else None

  if task in MECHANISM_TASKS:
    batched = make_task_dataset(
      d, tokenizer, split=split, process_index=process_index, process_count=process_count
    ).to_iter_dataset(read_options)
  elif task == "passkey":
    source = get_data_source(d.dataset, split, d.data_dir, d.get("source_dir"))
    batched = make_passkey_dataset(
      d, tokenizer, source, split=split, process_index=process_index, process_count=process_count
    ).to_iter_dataset(read_options)
  else:
    ds = grain.MapDataset.source(get_data_source(d.dataset, split, d.data_dir, d.get("source_dir")))
    if shuffle:
      ds = ds.shuffle(seed=d.shuffle_seed)
    ds = ds.repeat()[process_index::process_count]
    ds = ds.map(functools.partial(_tokenize, tokenizer=tokenizer, text_key=d.text_key))
    packed = grain.experimental.ConcatThenSplitIterDataset(
      ds.to_iter_dataset(read_options), length_struct={"tokens": d.seq_len + 1}
    )
    batched = packed.batch(d.batch_size // process_count, drop_remainder=True)
    batched = batched.map(functools.partial(_to_inputs_and_targets, pad_id=tokenizer.pad_id))
  if threads:
    batched = grain.experimental.multithread_prefetch(batched, num_threads=d.worker_count, buffer_size=1)
  elif d.worker_count > 0:
    # grain's workers read absl flags, which only a command line parses: from a notebook or
    # a test, their defaults stand.
    if not absl_flags.FLAGS.is_parsed():
      absl_flags.FLAGS.mark_as_parsed()
    batched = batched.mp_prefetch(
      grain.MultiprocessingOptions(num_workers=d.worker_count), worker_init_fn=_leave_stop_signals_to_the_trainer
    )
  if prefetch > 0:
    batched = grain.experimental.ThreadPrefetchIterDataset(batched, prefetch_buffer_size=prefetch)
  return batched


def _leave_stop_signals_to_the_trainer(worker_index: int, worker_count: int) -> None:
  """Ctrl-C, `timeout` and cluster schedulers signal the whole process group: a worker that
  died of it would fail the batch the trainer reads while it saves its checkpoint. The
  trainer closes its workers itself (grain stops and, if need be, kills them).

  This runs only once the worker has started (imported its modules): a signal to the group
  before then still kills it. The train iterators' workers start at the first step; the
  evaluation reads with threads (`worker_threads`), not with workers of its own."""
  del worker_index, worker_count
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGTERM, signal.SIG_IGN)


def close_iterators(iterators) -> None:
  """Closes `make_lm_iterator` iterators, all at once: closing one waits for each of its worker
  processes to finish its batch and exit, and one iterator after another those waits add up
  (a run of several seeds has an iterator per seed)."""
  iterators = list(iterators)
  if len(iterators) < 2:
    for iterator in iterators:
      iterator.close()
    return
  with concurrent.futures.ThreadPoolExecutor(len(iterators)) as pool:
    for done in [pool.submit(iterator.close) for iterator in iterators]:
      done.result()


def make_lm_iterator(
  data_config,
  tokenizer: Tokenizer,
  *,
  split: str,
  shuffle: bool,
  process_index: int | None = None,
  process_count: int | None = None,
  prefetch: int = 0,
  worker_threads: bool = False,
):
  """A checkpointable iterator (get_state/set_state) over `make_lm_dataset`; call
  its `close()` when done (it stops a prefetch thread or worker processes)."""
  return iter(
    make_lm_dataset(
      data_config,
      tokenizer,
      split=split,
      shuffle=shuffle,
      process_index=process_index,
      process_count=process_count,
      prefetch=prefetch,
      worker_threads=worker_threads,
    )
  )
