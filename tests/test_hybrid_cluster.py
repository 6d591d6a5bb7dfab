"""Embeddings on ps tasks, the rest replicated, one synchronous step.

Every task (ps tasks too) runs `tests/hybrid_job.py` under
`replicate.launch.LocalCluster`: a CTR model whose tables are partitioned
(`fixed_size_partitioner`), trained with `variable_strategy="replicated"`
in a cluster with ps tasks. Each run is compared with the unwrapped
`model_fn` on one device, on the concatenation of every task's batches
(chief first), to 1e-5: every variable (the tables' parts, their slots,
the dense layers, Adam's powers) and the global step, on every task and in
the chief's checkpoint. Then: where the tables live (no task holds a copy,
by placement and by resident memory), checkpoints moving between the
cluster, one machine's towers and one device, and the ps tasks' faults.

Slow (a cluster per test): run by `make test-multiworker`.
"""

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate import launch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hybrid_job  # noqa: E402  pylint: disable=wrong-import-position
import test_docs  # noqa: E402  pylint: disable=wrong-import-position
from test_sync_multiworker import Lines  # noqa: E402  pylint: disable=wrong-import-position
from test_sync_multiworker import MARGIN  # noqa: E402  pylint: disable=wrong-import-position
from test_sync_multiworker import TIMEOUT  # noqa: E402  pylint: disable=wrong-import-position
from test_sync_multiworker import TOLERANCE  # noqa: E402  pylint: disable=wrong-import-position


def _tasks(workers):
  return [("chief", 0)] + [("worker", i) for i in range(workers - 1)]


def _cluster(model_dir, workers, max_steps, batches, log, num_ps=1,
             *options, timeout=TIMEOUT, env=None):
  command = [sys.executable, os.path.join(HERE, "hybrid_job.py"),
             str(model_dir), str(max_steps), batches] + list(options)
  # The tasks import this tree's replicate, not an installed one.
  path = os.pathsep.join(filter(None, [str(test_docs.REPOSITORY),
                                       os.environ.get("PYTHONPATH")]))
  return launch.LocalCluster(
      command, num_ps=num_ps, num_workers=workers, log=log,
      env=dict({"REPLICATE_SYNC_TIMEOUT_SECS": str(timeout),
                "TF_CPP_MIN_LOG_LEVEL": "1", "PYTHONPATH": path},
               **(env or {})))


def _run(model_dir, workers, max_steps, batches, *options, num_ps=1,
         timeout=TIMEOUT, env=None):
  """Runs the job to its end; every training task's exit code, the log."""
  log = Lines()
  with _cluster(model_dir, workers, max_steps, batches, log, num_ps,
                *options, timeout=timeout, env=env) as cluster:
    codes = {"{}:{}".format(*task): cluster.wait(*task, timeout=240)
             for task in _tasks(workers)}
  assert codes == {"{}:{}".format(*t): 0 for t in _tasks(workers)}, (
      log.text()[-4000:])
  return log


def _concatenated(batches, steps, start=0, fields=hybrid_job.FIELDS):
  """The one-device input: step s's batches of every task, chief first."""
  per_task = hybrid_job.sync_job.parse_batches(batches)

  def input_fn():
    def generate():
      for step in range(start, steps):
        parts = [hybrid_job.batch(rank, step, rows[step], fields)
                 for rank, rows in enumerate(per_task)]
        yield ({key: np.concatenate([p[0][key] for p in parts])
                for key in ("ids", "x")},
               np.concatenate([p[1] for p in parts]))

    return tf.data.Dataset.from_generator(generate, output_signature=(
        {"ids": tf.TensorSpec([None, fields], tf.int64),
         "x": tf.TensorSpec([None, hybrid_job.DENSE], tf.float32)},
        tf.TensorSpec([None, 1], tf.float32)))

  return input_fn


def _one_machine(model_dir, batches, steps, optimizer="adam", towers=1,
                 start=0, model="ctr", fields=hybrid_job.FIELDS, clip=0.0):
  """The model on one device, unwrapped (or on one machine's `towers`,
  "replicated"), on the concatenated batches; the checkpoint's values."""
  model_fn = hybrid_job.MODEL_FNS[model]
  wrap = lambda optimizer: optimizer  # noqa: E731
  config = tf.estimator.RunConfig(model_dir=str(model_dir),
                                  tf_random_seed=hybrid_job.SEED)
  if towers > 1:
    model_fn = replicate.replicate_model_fn(model_fn,
                                            variable_strategy="replicated")
    wrap = replicate.TowerOptimizer
    config = config.replace(session_config=tf.compat.v1.ConfigProto(
        device_count={"CPU": towers}))
  estimator = tf.estimator.Estimator(
      model_fn, config=config,
      params={"optimizer": optimizer, "shards": 2, "wrap": wrap,
              "clip": clip})
  estimator.train(_concatenated(batches, steps, start, fields),
                  max_steps=steps)
  reader = tf.train.load_checkpoint(str(model_dir))
  return {name: reader.get_tensor(name)
          for name in reader.get_variable_to_shape_map()}


def _assert_like(values, expected, where, every=True):
  if every:
    assert sorted(values) == sorted(expected), where
  else:
    assert set(values) <= set(expected), (where, set(values) - set(expected))
  for name, value in values.items():
    np.testing.assert_allclose(value, expected[name], rtol=TOLERANCE,
                               atol=TOLERANCE,
                               err_msg="{}: {}".format(where, name))


def _task_values(model_dir, job, index):
  path = os.path.join(str(model_dir), "values-{}-{}.npz".format(job, index))
  with np.load(path) as values:
    return dict(values)


def _joined(values):
  """A task's values, each table's parts (`table_0/part_1`, its slots
  `table_0/part_1/Adam`) joined along rows as the checkpoint saves them
  (`table_0`, `table_0/Adam`)."""
  joined, parts = {}, {}
  for name, value in values.items():
    match = re.fullmatch(r"(.*)/part_(\d+)(/.*)?", name)
    if match:
      parts.setdefault(match.group(1) + (match.group(3) or ""), {})[
          int(match.group(2))] = value
    else:
      joined[name] = value
  for name, by_index in parts.items():
    joined[name] = np.concatenate([by_index[i] for i in sorted(by_index)])
  return joined


def _assert_every_task_like(model_dir, workers, expected, ps_saved=True):
  """The chief's values and checkpoint hold every variable, as one
  device's; a worker's what it reads (no slots of the ps tables).
  `ps_saved=False`: the tasks' values leave out the ps tasks' variables
  (`--report-memory`); the checkpoint still has them all."""
  reader = tf.train.load_checkpoint(str(model_dir))
  _assert_like({name: reader.get_tensor(name)
                for name in reader.get_variable_to_shape_map()}, expected,
               "the chief's checkpoint")
  for job, index in _tasks(workers):
    values = _joined(_task_values(model_dir, job, index))
    _assert_like(values, expected, "{}:{}".format(job, index),
                 every=job == "chief" and ps_saved)


@pytest.mark.parametrize("optimizer,workers,towers,num_ps,fields", [
    ("adam", 2, "1,2", 1, 3), ("adagrad", 2, "2", 2, 26),
    ("sgd", 2, "2,1", 1, 3), ("ftrl", 3, "1,2,1", 2, 3)])
def test_tables_on_ps_train_as_one_device(tmp_path, optimizer, workers,
                                          towers, num_ps, fields):
  # Uneven batches, an empty one on a worker, a batch of 1 row, ids
  # repeating within and across tasks; with Adagrad 26 fields (a CTR
  # model's: 52 parts, their slices in the step's shared gathers).
  batches = ("5,2,4;3,6,0" if workers == 2 else "5,2,4;3,6,0;1,0,7")
  _run(tmp_path / "cluster", workers, 3, batches, "--optimizer", optimizer,
       "--towers", towers, "--fields", str(fields), num_ps=num_ps)
  expected = _one_machine(tmp_path / "reference", batches, 3, optimizer,
                          fields=fields)
  assert expected["global_step"] == 3
  reader = tf.train.load_checkpoint(str(tmp_path / "cluster"))
  # Saved as one device saves them: each table whole, from its 2 parts.
  assert reader.get_variable_to_shape_map()["table_0"] == [
      hybrid_job.VOCABULARY, hybrid_job.DIMENSION]
  _assert_every_task_like(tmp_path / "cluster", workers, expected)
  # The tables' slots (SGD has none) are the chief's: it alone updates them.
  slots = {"adam": "Adam", "adagrad": "Adagrad", "ftrl": "Ftrl"}
  if optimizer in slots:
    slot = "table_0/part_0/" + slots[optimizer]
    assert slot in _task_values(tmp_path / "cluster", "chief", 0)
    assert slot not in _task_values(tmp_path / "cluster", "worker", 0)


@pytest.mark.parametrize("clip,clip_by,straight,gathered", [
    (0.0, "code", 6, 0), (0.05, "code", 0, 6), (0.05, "transformer", 0, 6)])
def test_slices_go_straight_to_the_ps_unless_the_model_fn_reads_them(
    tmp_path, clip, clip_by, straight, gathered):
  # Without a clip, each task's slices of the 6 parts go straight to the
  # ps, which applies their sum once; with a clip by global norm (in the
  # model_fn's code, or TowerOptimizer's gradient_transformers, which
  # every task runs), which reads them on every task, every task gathers
  # every task's. Either way one device's step: 3 tasks, uneven, empty
  # and 1-row batches, rows repeating within and across tasks, 2 towers
  # on a task.
  batches = "5,2,4;3,6,0;1,0,7"
  log = _run(tmp_path / "cluster", 3, 3, batches, "--optimizer", "adam",
             "--towers", "1,2,1", "--clip", str(clip), "--clip-by", clip_by,
             num_ps=2)
  said = ("Slices of the ps tasks' variables: {} straight to the ps, {} "
          "gathered to every task".format(straight, gathered))
  assert log.text().count(said) == 3, log.text()[-3000:]
  expected = _one_machine(tmp_path / "reference", batches, 3, "adam",
                          clip=clip)
  _assert_every_task_like(tmp_path / "cluster", 3, expected)


def test_no_task_holds_a_copy_of_a_table(tmp_path):
  # By placement: every part of every table, and its slots, on a ps task,
  # none on a training task (no `tower_1/table_0/part_0` copy either); the
  # dense layers on each task. Then by memory: tables of 2M x 16 floats
  # (128 MB each, 384 MB in all; with Adam's two slots 1.1 GB on the ps)
  # leave every training task's peak resident memory where tables of 40
  # rows leave it.
  log = _run(tmp_path / "small", 2, 2, "4,4;4,4", "--report-memory")
  small = _memory(log)
  placed = _placements(log, "chief:0")
  tables = {name: device for name, device in placed.items()
            if name.startswith("table_")}
  assert len(tables) == 3 * hybrid_job.FIELDS * 2  # parts, Adam's 2 slots
  assert all("/job:ps/" in device for device in tables.values()), tables
  assert not any(name.startswith("tower_1/table_") for name in placed)
  assert all("/job:chief/" in device for name, device in placed.items()
             if name.startswith(("hidden/", "logits/", "tower_1/hidden/"))
             ), placed
  assert "/job:chief/" in placed["global_step"]
  assert "/job:chief/" in placed["beta1_power"]
  # The ps initialises the large tables before the first step: a longer
  # timeout for the start.
  log = _run(tmp_path / "large", 2, 2, "4,4;4,4", "--report-memory",
             "--vocabulary", str(2 * 10 ** 6), "--dimension", "16",
             timeout=60)
  large = _memory(log)
  tables_mb = hybrid_job.FIELDS * 2 * 10 ** 6 * 16 * 4 / 2 ** 20
  print("peak resident MB, 40-row tables: {}; tables of {:.0f} MB in all: "
        "{}".format(small, tables_mb, large))
  for task in ("chief:0", "worker:0"):
    assert large[task] - small[task] < 0.1 * tables_mb, (task, small, large)


def _placements(log, task):
  found = {}
  for line in log.of(task).splitlines():
    match = re.search(r"hybrid_job: placed (\S+) (\S+)", line)
    if match:
      found[match.group(1)] = match.group(2)
  return found


def _memory(log):
  found = {}
  for line in log.text().splitlines():
    match = re.search(r"\[(\S+)\] hybrid_job: resident MB (\d+)", line)
    if match:
      found[match.group(1)] = int(match.group(2))
  return found


def test_a_checkpoint_moves_between_the_cluster_one_machine_and_back(
    tmp_path):
  # The cluster trains steps 1-2 and stops (the chief saving after every
  # step, while the worker waits in the next); one machine's 2 towers
  # ("replicated", no cluster) train step 3 from its checkpoint; the
  # cluster, every task restarted, steps 4-5. The tables are saved under
  # the unwrapped names and partitioning: the end equals one device's 5
  # uninterrupted steps.
  batches = "5,2,4,3,6;3,6,0,4,2"
  model_dir = tmp_path / "moved"
  _run(model_dir, 2, 2, batches, "--save-every", "1")
  assert tf.train.latest_checkpoint(str(model_dir)).endswith("-2")
  _one_machine(model_dir, batches, 3, towers=2, start=2)
  log = _run(model_dir, 2, 5, batches)
  assert "hybrid_job: step 4" in log.of("worker:0")
  expected = _one_machine(tmp_path / "reference", batches, 5)
  _assert_every_task_like(model_dir, 2, expected)


def test_a_canned_wide_and_deep_with_partitioned_inputs(tmp_path):
  # DNNLinearCombinedClassifier (TF 1 canned) with input_layer_partitioner:
  # its embeddings on the ps tasks, the DNN and the linear part's
  # unpartitioned variables replicated; Adagrad and FTRL. The worker's
  # batch is empty at step 2: its towers' feature columns read 0 rows (the
  # linear model's SparseReshape to [rows, -1] fails there unguarded).
  batches = "5,2,4;3,0,1"
  _run(tmp_path / "cluster", 2, 3, batches, "--canned", "--optimizer",
       "adagrad")
  expected = _one_machine(tmp_path / "reference", batches, 3, "adagrad",
                          model="canned")
  # The embeddings were partitioned (parts in the task's values), and are
  # compared whole.
  parts = [name for name in _task_values(tmp_path / "cluster", "chief", 0)
           if "/part_" in name]
  assert any("id_0_embedding/embedding_weights/part_1" in p for p in parts), (
      parts)
  _assert_every_task_like(tmp_path / "cluster", 2, expected)


def test_a_canned_dnn_keeps_its_hidden_layers_off_the_ps(tmp_path):
  # DNNClassifier (TF 1 canned): TensorFlow partitions its `dnn` scope by
  # the number of ps tasks, so its hidden layers and logits are partitioned
  # variables too; they are read whole, so they are replicated (a copy on
  # every tower, all-reduced), and only the embeddings, looked up by rows,
  # live on the ps tasks. Saved as one device saves them; exact.
  batches = "5,2,4;3,6,1"
  # SGD: TensorFlow's own checkpoint of a DNNClassifier's Adagrad slots
  # of partitioned inputs does not read back on one device ("Does not have
  # sufficient slices for ... embedding_weights/t_0/Adagrad").
  log = _run(tmp_path / "cluster", 2, 3, batches, "--canned-dnn",
             "--optimizer", "sgd", "--report-memory", num_ps=2)
  placed = _placements(log, "chief:0")
  dense = {name: device for name, device in placed.items()
           if name.startswith(("dnn/hiddenlayer_", "dnn/logits/"))}
  assert "dnn/hiddenlayer_0/kernel/part_0" in dense, placed
  assert all("/job:chief/" in device for device in dense.values()), dense
  # Tower 1's copies of them, as of any dense variable.
  assert "tower_1/dnn/hiddenlayer_1/kernel/part_0" in placed, placed
  tables = {name: device for name, device in placed.items()
            if "embedding_weights/part_" in name}
  assert len(tables) == 2 * hybrid_job.FIELDS, tables
  assert all("/job:ps/" in device for device in tables.values()), tables
  assert not any(name.startswith("tower_1/") and "embedding_weights" in name
                 for name in placed)
  # One INFO line a call says where each went.
  [line] = [line for line in log.of("chief:0").splitlines()
            if "replicate: with ps tasks, on the ps tasks" in line]
  assert ("dnn/input_from_feature_columns/input_layer/id_0_embedding/"
          "embedding_weights (2 parts)") in line.split("replicated")[0]
  assert "dnn/hiddenlayer_0/kernel (1 part)" in line.split("replicated")[1]
  expected = _one_machine(tmp_path / "reference", batches, 3, "sgd",
                          model="canned-dnn")
  _assert_every_task_like(tmp_path / "cluster", 2, expected, ps_saved=False)


def test_under_tf1_behavior_with_resource_variables(tmp_path):
  # Every task under TensorFlow 1 behaviour (v1 control flow, Dimension
  # shapes) with resource variables, as "replicated" needs on one machine
  # too: exact, an empty batch included.
  batches = "5,2,4;3,0,1"
  _run(tmp_path / "cluster", 2, 3, batches, "--optimizer", "adagrad",
       env={"REPLICATE_TF1_BEHAVIOR": "1"})
  expected = _one_machine(tmp_path / "reference", batches, 3, "adagrad")
  _assert_every_task_like(tmp_path / "cluster", 2, expected)


def test_under_tf1_behavior_ref_variables_are_refused_with_the_fix(
    tmp_path):
  log = Lines()
  with _cluster(tmp_path / "cluster", 2, 3, "4,4;4,4", log, 1,
                "--ref-variables",
                env={"REPLICATE_TF1_BEHAVIOR": "1"}) as cluster:
    codes = [cluster.wait(*task, timeout=240) for task in _tasks(2)]
  assert codes == [1, 1], log.text()[-3000:]
  for task in ("chief:0", "worker:0"):
    assert ("Tower 1 needs its own copy of 'hidden/kernel', which is a ref "
            "variable (use_resource=False)" in log.of(task)), (
                log.of(task)[-3000:])


def test_a_partitioned_variable_every_task_would_write_is_refused(tmp_path):
  # Not trainable (a statistic its UPDATE_OPS move): every task would
  # update the one copy on the ps tasks, once each.
  log = Lines()
  with _cluster(tmp_path / "cluster", 2, 3, "4,4;4,4", log, 1,
                "--partitioned-statistic") as cluster:
    codes = [cluster.wait(*task, timeout=240) for task in _tasks(2)]
  assert codes == [1, 1], log.text()[-3000:]
  for task in ("chief:0", "worker:0"):
    assert ("The variable 'feature_mean' is partitioned and not trainable"
            in log.of(task) and "Create it without a partitioner" in
            log.of(task)), log.of(task)[-3000:]


def _fault_the_ps(tmp_path, sig, num_ps, timeout):
  """Trains until step 20, sends `sig` to the last ps task; the training
  tasks' exit codes, how long after the signal they all exited, the log."""
  log = Lines()
  with _cluster(tmp_path / "cluster", 2, 100000, "4*100000;4*100000",
                log, num_ps, timeout=timeout) as cluster:
    log.wait_for("chief:0", "hybrid_job: step 20")
    cluster.kill("ps", num_ps - 1, sig)
    faulted = time.monotonic()
    codes = {task: cluster.wait(*task, timeout=timeout + MARGIN + 60)
             for task in _tasks(2)}
    elapsed = time.monotonic() - faulted
  return codes, elapsed, log


# A dead ps ends the step in this many seconds, whatever the timeout.
DEAD_PS_BOUND = 10


@pytest.mark.parametrize("num_ps", [1, 2])
def test_a_dead_ps_ends_every_task_in_seconds_naming_it(num_ps, tmp_path):
  # SIGKILL: its port refuses connections at once, which every training
  # task's probe sees; the timeout (60 s) is not waited for. Before, 7 kills
  # of 8 waited the whole timeout (the session made again after the
  # step's UnavailableError waits on the dead ps).
  codes, elapsed, log = _fault_the_ps(tmp_path, signal.SIGKILL, num_ps,
                                      timeout=60)
  print("ps:{} killed ({} ps): the training tasks exited with {} {:.1f} s "
        "after (timeout 60 s)".format(num_ps - 1, num_ps, codes, elapsed))
  for task, code in codes.items():
    text = log.of("{}:{}".format(*task))
    assert code == 1, text[-3000:]
    assert ("replicate: task {}:{} lost ps task ps:{} (127.0.0.1:".format(
        task[0], task[1], num_ps - 1) in text), text[-3000:]
  assert elapsed < DEAD_PS_BOUND, (elapsed, log.text()[-3000:])


def test_a_frozen_ps_ends_every_task_within_the_timeout(tmp_path):
  # SIGSTOP: its sockets stay open and its port still accepts connections,
  # so only the watchdog's timeout ends the step.
  codes, elapsed, log = _fault_the_ps(tmp_path, signal.SIGSTOP, 1, TIMEOUT)
  print("ps:0 frozen: the training tasks exited with {} {:.1f} s after "
        "(bound {:g} s)".format(codes, elapsed, TIMEOUT))
  for task, code in codes.items():
    text = log.of("{}:{}".format(*task))
    assert code == 1, text[-3000:]
    assert "has been running a step for over" in text, text[-3000:]
    assert "lost ps task" not in text, text[-3000:]
  assert elapsed < TIMEOUT + MARGIN, (elapsed, log.text()[-3000:])


def _docs_program(recipe_constants):
  """docs/multi-worker.md's hybrid program, as its text says to make it:
  the first section's program with the recipe's `model_fn` and
  `input_fn` (and their constants replaced by `recipe_constants`)."""
  path = test_docs.REPOSITORY / "docs" / "multi-worker.md"
  [program, recipe] = [code for language, code in test_docs.blocks(path)
                       if language == "python"]
  constants = "FIELDS, ROWS, WIDTH = 26, 1000000, 16"
  assert constants in recipe
  imports = program[:program.index("def model_fn(")]
  end = program[program.index("config = tf.estimator.RunConfig("):]
  assert end.rstrip().endswith("estimator.train(input_fn, max_steps=8)")
  return "{}{}\n\n{}".format(
      imports, recipe.replace(constants, recipe_constants), end)


def test_the_docs_program_runs_as_written_on_ps_tasks(tmp_path):
  # The program ends with estimator.train, which TensorFlow refuses on a ps
  # task: start_server serves there and never returns to it. Tiny tables.
  (tmp_path / "train.py").write_text(
      _docs_program("FIELDS, ROWS, WIDTH = 3, 40, 4"))
  started = time.monotonic()
  done = subprocess.run(
      [sys.executable, "-m", "replicate.launch", "--ps", "2", "--workers",
       "2", "--", sys.executable, "train.py"], cwd=tmp_path,
      capture_output=True, text=True, timeout=300,
      env=dict(os.environ, PYTHONPATH=str(test_docs.REPOSITORY),
               TF_CPP_MIN_LOG_LEVEL="2"))
  print("the docs' program on 2 tasks and 2 ps: {:.1f} s".format(
      time.monotonic() - started))
  assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
  # Before, each ps task's train failed at once ("Train has been called
  # wrong configuration"), and the launcher stops every task at a failure.
  assert "[launch] ps:" not in done.stdout, done.stdout[-4000:]
  reader = tf.train.load_checkpoint(str(tmp_path / "model"))
  assert reader.get_tensor("global_step") == 8
  # Each table saved whole, from its 4 parts on the 2 ps tasks.
  assert reader.get_variable_to_shape_map()["table_2"] == [40, 4]
