"""Synchronous training across tasks (no ps), on loopback clusters.

Every task runs `tests/sync_job.py` under `replicate.launch.LocalCluster`:
2 and 3 tasks of 2 towers (or 1, 2 and 1), uneven batches across tasks,
empty batches, inputs that end at different steps, a resume, a one-device
checkpoint, a synchronized batch norm, an embedding's sparse gradients,
in-batch negatives through `replicate.all_rows` and `row_offset`, and
`clip_by_global_norm` after `compute_gradients` and after `tf.gradients`.
Each run is compared with the unwrapped `model_fn` on one device, on the
concatenation of every task's batches (chief first), to 1e-5: every
variable (weights, Adam slots and powers, the moving mean, the tower-local
row count, batch norm's moving statistics) and the global step, on every
task and in the chief's checkpoint.

The faults kill (SIGKILL) or freeze (SIGSTOP) a task at a point its own
log lines mark, and assert that the others exit with an error within the
documented bound: `REPLICATE_SYNC_TIMEOUT_SECS` (8 s here) for a step or
a start the others wait in, twice that plus 10 s for a worker whose chief
is gone before its first step (the watchdog's bound on a start). The
margin allows for 2 shared cores starting up to 3 TensorFlow processes.

Slow (a cluster per test): run by `make test-multiworker`.
"""

import io
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from replicate import launch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import sync_job  # noqa: E402  pylint: disable=wrong-import-position

TIMEOUT = 8.0
START = 2 * TIMEOUT + 10  # the watchdog's bound on a session's start
MARGIN = 15.0  # process start-up and exit on 2 loaded cores
TOLERANCE = 1e-5


class Lines(io.TextIOBase):
  """The launcher's log: every line kept, with the time it came."""

  def __init__(self):
    self.lines = []
    self._changed = threading.Condition()

  def write(self, text):
    with self._changed:
      for line in text.splitlines():
        self.lines.append((time.monotonic(), line))
      self._changed.notify_all()
    return len(text)

  def wait_for(self, task, text, timeout=120):
    """Waits until `task`'s log has a line containing `text`."""
    prefix = "[{}] ".format(task)
    with self._changed:
      found = self._changed.wait_for(
          lambda: any(line.startswith(prefix) and text in line
                      for _, line in self.lines), timeout)
    assert found, "no line {!r} from {} in {} s:\n{}".format(
        text, task, timeout, self.text()[-3000:])

  def text(self):
    return "\n".join(line for _, line in self.lines)

  def of(self, task):
    prefix = "[{}] ".format(task)
    return "\n".join(line for _, line in self.lines if line.startswith(prefix))


def _cluster(model_dir, tasks, max_steps, batches, log, hidden="4",
             batch_norm=None, chief_late=0, towers="2", embedding=False,
             weight_decay=False, static=False, sparse_optimizers=False,
             read_loss=False, negatives=False, clip=None):
  command = [sys.executable, os.path.join(HERE, "sync_job.py"),
             str(model_dir), str(max_steps), batches, "--hidden", hidden,
             "--towers", towers]
  if batch_norm:
    command += ["--batch-norm", batch_norm]
  if embedding:
    command += ["--embedding"]
  if weight_decay:
    command += ["--weight-decay"]
  if static:
    command += ["--static"]
  if sparse_optimizers:
    command += ["--sparse-optimizers"]
  if read_loss:
    command += ["--read-loss"]
  if negatives:
    command += ["--negatives"]
  if clip:
    command += ["--clip", clip]
  if chief_late:  # the chief's process starts `chief_late` s after the rest
    command = ["sh", "-c", 'case "$TF_CONFIG" in *\'"type": "chief"\'*) '
               "sleep {};; esac; exec \"$@\"".format(chief_late), "sh"
              ] + command
  return launch.LocalCluster(
      command, num_ps=0, num_workers=tasks, log=log,
      env={"REPLICATE_SYNC_TIMEOUT_SECS": str(TIMEOUT),
           "TF_CPP_MIN_LOG_LEVEL": "1"})


def _task_names(tasks):
  return [("chief", 0)] + [("worker", i) for i in range(tasks - 1)]


def _run(model_dir, tasks, max_steps, batches, hidden="4", batch_norm=None,
         towers="2", embedding=False, weight_decay=False, static=False,
         sparse_optimizers=False, read_loss=False, negatives=False, clip=None):
  """Runs the job to its end; returns every task's exit code and the log."""
  log = Lines()
  with _cluster(model_dir, tasks, max_steps, batches, log, hidden,
                batch_norm, towers=towers, embedding=embedding,
                weight_decay=weight_decay, static=static,
                sparse_optimizers=sparse_optimizers,
                read_loss=read_loss, negatives=negatives,
                clip=clip) as cluster:
    codes = {"{}:{}".format(*task): cluster.wait(*task, timeout=240)
             for task in _task_names(tasks)}
  return codes, log


def _reference(model_dir, batches, steps, batch_norm=None, embedding=False,
               weight_decay=False, sparse_optimizers=False, max_steps=None,
               negatives=False, clip=None):
  """The unwrapped model_fn on one device, on the concatenated batches."""
  per_task = sync_job.parse_batches(batches)

  def input_fn():
    def generate():
      for step in range(steps):
        parts = [sync_job.batch(rank, step, rows[step])
                 for rank, rows in enumerate(per_task)]
        yield ({"x": np.concatenate([p[0] for p in parts]),
                "w": np.concatenate([p[2] for p in parts])},
               np.concatenate([p[1] for p in parts]))

    return tf.data.Dataset.from_generator(generate, output_signature=(
        {"x": tf.TensorSpec([None, sync_job.FEATURES], tf.float32),
         "w": tf.TensorSpec([None], tf.float32)},
        tf.TensorSpec([None], tf.int64)))

  estimator = tf.estimator.Estimator(
      sync_job.model_fn, model_dir=str(model_dir),
      params={"hidden": 4, "batch_norm": batch_norm, "embedding": embedding,
              "weight_decay": weight_decay,
              "sparse_optimizers": sparse_optimizers,
              "negatives": negatives, "clip": clip,
              "wrap": lambda optimizer: optimizer})
  estimator.train(input_fn, max_steps=max_steps)
  reader = tf.train.load_checkpoint(str(model_dir))
  return {name: reader.get_tensor(name)
          for name in reader.get_variable_to_shape_map()}


def _assert_like(values, expected, where):
  assert sorted(values) == sorted(expected), where
  for name, value in expected.items():
    np.testing.assert_allclose(values[name], value, rtol=TOLERANCE,
                               atol=TOLERANCE, err_msg="{}: {}".format(
                                   where, name))


def _assert_every_task_like(model_dir, tasks, expected):
  for job, index in _task_names(tasks):
    with np.load(os.path.join(str(model_dir), "values-{}-{}.npz".format(
        job, index))) as values:
      _assert_like(dict(values), expected, "{}:{}".format(job, index))
  reader = tf.train.load_checkpoint(str(model_dir))
  _assert_like({name: reader.get_tensor(name)
                for name in reader.get_variable_to_shape_map()}, expected,
               "the chief's checkpoint")


def test_two_tasks_with_uneven_and_empty_batches_train_as_one_device(
    tmp_path):
  batches = "6,5,4;5,0,3"  # the worker's second batch has no rows
  codes, log = _run(tmp_path / "cluster", 2, 10, batches)
  assert codes == {"chief:0": 0, "worker:0": 0}, log.text()[-3000:]
  expected = _reference(tmp_path / "reference", batches, 3)
  assert expected["global_step"] == 3
  assert expected["rows_seen"] == 23  # the tower-local sum over tasks
  _assert_every_task_like(tmp_path / "cluster", 2, expected)
  # Only the chief writes summaries (and checkpoints, read above).
  events = [name for name in os.listdir(tmp_path / "cluster")
            if name.startswith("events.out.tfevents")]
  assert len(events) == 1, events


def test_two_tasks_combine_a_weighted_loss_read_from_the_graph(tmp_path):
  # No loss_denominator: the loss rule reads the weighted MEAN (a ratio of
  # sums) and the regularization (once), and sums every ratio's
  # denominator over both tasks' towers.
  batches = "6,5,4;5,0,3"
  codes, log = _run(tmp_path / "cluster", 2, 10, batches, read_loss=True)
  assert codes == {"chief:0": 0, "worker:0": 0}, log.text()[-3000:]
  expected = _reference(tmp_path / "reference", batches, 3)
  _assert_every_task_like(tmp_path / "cluster", 2, expected)


def _assert_clip_active(model_dir, batches, steps, expected, **kwargs):
  """The reference without the clip ends elsewhere: the clip was active."""
  unclipped = _reference(model_dir, batches, steps, clip="unclipped",
                         **kwargs)
  assert not np.allclose(unclipped["hidden/kernel"], expected["hidden/kernel"],
                         rtol=1e-3)


def test_in_batch_negatives_through_all_rows_and_a_clip_are_one_devices(
    tmp_path):
  # Two-tower retrieval: each row's query against every item of the whole
  # batch (replicate.all_rows: the chief's rows, then the worker's), its own
  # item's index replicate.row_offset() + r; and clip_by_global_norm
  # between compute_gradients and apply_gradients, clip active. Uneven
  # batches on tasks of 1 and 2 towers; at step 2 the chief has no rows at
  # all and the worker's second tower none (1 row on 2 towers).
  batches = "6,0,4;5,1,3"
  codes, log = _run(tmp_path / "cluster", 2, 10, batches, towers="1,2",
                    negatives=True, clip="compute")
  assert codes == {"chief:0": 0, "worker:0": 0}, log.text()[-3000:]
  expected = _reference(tmp_path / "reference", batches, 3, negatives=True,
                        clip="compute")
  assert {"query/kernel", "item/kernel"} <= set(expected)
  _assert_every_task_like(tmp_path / "cluster", 2, expected)
  _assert_clip_active(tmp_path / "unclipped", batches, 3, expected,
                      negatives=True)


def test_a_clip_after_tf_gradients_is_one_devices(tmp_path):
  # BERT's way: tf.gradients of the loss, clip_by_global_norm, then
  # TowerOptimizer.apply_gradients: every task's towers clip the gradient
  # of the concatenated batch. Tasks of 1 and 2 towers, an empty batch.
  batches = "6,5,4;5,0,3"
  codes, log = _run(tmp_path / "cluster", 2, 10, batches, towers="1,2",
                    clip="gradients")
  assert codes == {"chief:0": 0, "worker:0": 0}, log.text()[-3000:]
  expected = _reference(tmp_path / "reference", batches, 3, clip="gradients")
  _assert_every_task_like(tmp_path / "cluster", 2, expected)
  _assert_clip_active(tmp_path / "unclipped", batches, 3, expected)


def test_workers_wait_for_a_late_chief_without_errors(tmp_path):
  log = Lines()
  with _cluster(tmp_path / "cluster", 2, 3, "4,4,4;4,4,4", log,
                chief_late=5) as cluster:
    codes = [cluster.wait(*task, timeout=120) for task in _task_names(2)]
  assert codes == [0, 0], log.text()[-3000:]
  worker = log.of("worker:0")
  assert "sync_job: step 3" in worker
  # No retries of the group leader: start_server waited for its port.
  assert "UNAVAILABLE" not in worker and " E tensorflow" not in worker, (
      worker[-3000:])


@pytest.mark.parametrize("batch_norm", ["fused", "plain"])
def test_batch_norm_synchronized_across_tasks_is_one_devices(tmp_path,
                                                              batch_norm):
  batches = "6,5,1;3,0,4;2,4,0"  # a batch of 1 row, empty batches
  codes, log = _run(tmp_path / "cluster", 3, 10, batches,
                    batch_norm=batch_norm)
  assert codes == {"chief:0": 0, "worker:0": 0, "worker:1": 0}, (
      log.text()[-3000:])
  expected = _reference(tmp_path / "reference", batches, 3, batch_norm)
  assert {"norm/moving_mean", "norm/moving_variance"} <= set(expected)
  _assert_every_task_like(tmp_path / "cluster", 3, expected)


def test_a_one_device_checkpoint_goes_on_training_on_the_cluster(tmp_path):
  batches = "5,3,4,6;4,6,0,3"
  model_dir = tmp_path / "cluster"
  _reference(model_dir, batches, 2)  # one device, steps 1-2, unwrapped
  codes, log = _run(model_dir, 2, 4, batches)  # the cluster: steps 3-4
  assert codes == {"chief:0": 0, "worker:0": 0}, log.text()[-3000:]
  assert "sync_job: step 3" in log.of("worker:0")
  _assert_every_task_like(model_dir, 2,
                          _reference(tmp_path / "reference", batches, 4))


@pytest.mark.parametrize("batch_norm", [None, "plain"])
def test_tasks_of_one_tower_and_of_two_together(tmp_path, batch_norm):
  # One GPU a machine is common: tasks of 1, 2 and 1 towers. With a
  # gradient not computed from the rows (weight decay as an optimizer call
  # of its own): the chief's tower 0 counts it, once for every task.
  batches = "3,5,2;4,0,6;1,2,3"
  codes, log = _run(tmp_path / "cluster", 3, 10, batches,
                    batch_norm=batch_norm, towers="1,2,1", weight_decay=True)
  assert codes == {"chief:0": 0, "worker:0": 0, "worker:1": 0}, (
      log.text()[-3000:])
  _assert_every_task_like(tmp_path / "cluster", 3, _reference(
      tmp_path / "reference", batches, 3, batch_norm, weight_decay=True))


def test_sparse_gradients_update_only_the_rows_looked_up(tmp_path):
  # An embedding lookup's gradients are IndexedSlices; Adam's rows not
  # looked up by any task's batch must not move differently than on one
  # device (an empty batch, a batch of 1 row).
  batches = "6,1,3;0,4,5"
  codes, log = _run(tmp_path / "cluster", 2, 10, batches, embedding=True)
  assert codes == {"chief:0": 0, "worker:0": 0}, log.text()[-3000:]
  expected = _reference(tmp_path / "reference", batches, 3, embedding=True)
  assert "embedding/Adam" in expected
  _assert_every_task_like(tmp_path / "cluster", 2, expected)


def test_sparse_gradients_cross_tasks_as_slices_for_every_optimizer(
    tmp_path):
  # An embedding each for SGD, Adam, Adagrad and FTRL (census wide & deep's
  # linear part), ids repeating within and across tasks; tasks of 1, 2 and
  # 1 towers, uneven batches, an empty one on each worker, a batch of 1
  # row: the slices of every task, all-gathered, equal one device's on the
  # concatenated batches (its optimizers sum the duplicates alike). The
  # cluster stops at the end of its input, in a fifth step that changes
  # nothing (v1 Adam's decay of every row of its slots needs no gradient,
  # and waits for the end-of-input check too); the reference stops at
  # max_steps, since on one device that decay may run in the step whose
  # input ended.
  batches = "6,1,3,5;0,4,5,2;3,2,0,7"
  codes, log = _run(tmp_path / "cluster", 3, 10, batches, towers="1,2,1",
                    sparse_optimizers=True)
  assert codes == {"chief:0": 0, "worker:0": 0, "worker:1": 0}, (
      log.text()[-3000:])
  expected = _reference(tmp_path / "reference", batches, 4,
                        sparse_optimizers=True, max_steps=4)
  assert {"table_sgd", "table_adam/Adam", "table_adagrad/Adagrad",
          "table_ftrl/Ftrl", "table_ftrl/Ftrl_1"} <= set(expected)
  _assert_every_task_like(tmp_path / "cluster", 3, expected)


def test_static_batches_of_different_sizes_on_each_task(tmp_path):
  # Each task's batch size known when its graph is built (7 rows on the
  # chief's 2 towers: 4 + 3; 3 on the worker's), different across tasks;
  # the worker's input ends first.
  batches = "7*4;3*3"
  codes, log = _run(tmp_path / "cluster", 2, 10, batches, static=True)
  assert codes == {"chief:0": 0, "worker:0": 0}, log.text()[-3000:]
  _assert_every_task_like(tmp_path / "cluster", 2,
                          _reference(tmp_path / "reference", batches, 3))


def test_three_tasks_stop_together_when_one_input_ends(tmp_path):
  # Worker 0's and worker 1's inputs end after 3 batches, the chief's has 4:
  # every task stops at step 3, cleanly.
  batches = "6,5,0,4;5,4,3;2,0,3"
  codes, log = _run(tmp_path / "cluster", 3, 10, batches)
  assert codes == {"chief:0": 0, "worker:0": 0, "worker:1": 0}, (
      log.text()[-3000:])
  assert "the input of worker:0, worker:1 ended" in log.of("chief:0")
  expected = _reference(tmp_path / "reference", batches, 3)
  _assert_every_task_like(tmp_path / "cluster", 3, expected)


def test_a_restarted_job_resumes_from_the_chiefs_checkpoint(tmp_path):
  batches = "5,3,4,6,2,4;4,6,0,3,5,2"
  model_dir = tmp_path / "cluster"
  codes, log = _run(model_dir, 2, 3, batches)  # steps 1-3, then stop
  assert codes == {"chief:0": 0, "worker:0": 0}, log.text()[-3000:]
  codes, log = _run(model_dir, 2, 6, batches)  # resumes: steps 4-6
  assert codes == {"chief:0": 0, "worker:0": 0}, log.text()[-3000:]
  # The worker starts from the chief's step 3 (broadcast), not from 0.
  assert "sync_job: step 4" in log.of("worker:0")
  assert "sync_job: step 1\n" not in log.of("worker:0") + "\n"
  _assert_every_task_like(model_dir, 2,
                          _reference(tmp_path / "reference", batches, 6))


def test_a_task_with_another_model_fails_every_task_at_the_start(tmp_path):
  codes, log = _run(tmp_path / "cluster", 3, 5, "4*5;4*5;4*5",
                    hidden="4,4,5")
  assert codes == {"chief:0": 1, "worker:0": 1, "worker:1": 1}
  for task in ("chief:0", "worker:0", "worker:1"):
    assert ("built different models" in log.of(task) and
            "differing from the chief: worker:1" in log.of(task)), task


# (task to fault, signal, the line of that task to fault it at, bound, what
# the other task's error says: the guard's, a collective's timeout at the
# start, the watchdog's).
LOST = "lost the synchronous cluster"
FAULTS = {
    "worker killed mid-run": ("worker:0", signal.SIGKILL, "sync_job: step 20",
                              TIMEOUT, [LOST]),
    "chief killed mid-run": ("chief:0", signal.SIGKILL, "sync_job: step 20",
                             TIMEOUT, [LOST]),
    "worker frozen mid-run": ("worker:0", signal.SIGSTOP, "sync_job: step 20",
                              TIMEOUT, ["has been running a step for over"]),
    "worker killed before its first step": (
        "worker:0", signal.SIGKILL, "sync_job: started", TIMEOUT,
        [LOST, "Collective has timed out"]),
    "chief killed before the worker's first step": (
        "chief:0", signal.SIGKILL, "sync_job: started", START,
        [LOST, "has been starting its session for over"]),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_dead_or_frozen_task_makes_the_others_exit_in_bounded_time(
    fault, tmp_path):
  victim, sig, line, bound, messages = FAULTS[fault]
  job, index = victim.split(":")
  log = Lines()
  with _cluster(tmp_path / "cluster", 2, 100000, "4*100000;4*100000",
                log) as cluster:
    log.wait_for(victim, line)
    cluster.kill(job, int(index), sig)
    faulted = time.monotonic()
    other = ("worker", 0) if job == "chief" else ("chief", 0)
    code = cluster.wait(*other, timeout=bound + MARGIN + 60)
    elapsed = time.monotonic() - faulted
  survivor = log.of("{}:{}".format(*other))
  print("{}: {}:{} exited with {} {:.1f} s after (bound {:g} s)".format(
      fault, other[0], other[1], code, elapsed, bound))
  assert code != 0, survivor[-3000:]
  assert elapsed < bound + MARGIN, (elapsed, survivor[-3000:])
  assert any(message in survivor for message in messages), survivor[-3000:]


def test_a_long_run_keeps_its_threads(tmp_path):
  # The step's collectives carry no timeout of their own: TensorFlow would
  # start a thread per run sleeping it out, ~5 per step here, until no
  # thread could start (helper runs died so at step ~2,700).
  log = Lines()
  with _cluster(tmp_path / "cluster", 2, 100000, "4*100000;4*100000",
                log) as cluster:
    log.wait_for("chief:0", "sync_job: step 50")
    early = _threads(cluster.process("chief", 0).pid)
    log.wait_for("chief:0", "sync_job: step 1000")
    late = _threads(cluster.process("chief", 0).pid)
  assert late <= early + 10, (early, late)


def _threads(pid):
  return len(os.listdir("/proc/{}/task".format(pid)))
