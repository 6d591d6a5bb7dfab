"""`replicate_model_fn`: one `model_fn`, one tower per device.

The build, per call of the wrapped `model_fn`, one sub-package a step:
1. `shard`: split the batch into one shard per tower;
2. `towers`: build the `model_fn` once per device, in the replication
   context;
3. `gradients`: inside each tower's optimizer call (`TowerOptimizer`),
   weight its gradients once and combine every tower's;
4. `gradients`: apply them once, tower 0's update on the sums;
5. `state`: what each tower's step changes, kept, made once, combined or
   refused;
6. `outputs`: one `EstimatorSpec` from the towers'.
Beside them: `call` (one call's bookkeeping, read by every step),
`variables` (where variables live, what a tower sees, the strategy's
mode), `communication` (all-reduce), `batch_norm` (synchronized batch
norm), `cluster` (`TF_CONFIG` clusters: synchronous, or with ps tasks).
`replicate_model_fn` checks its arguments when wrapping; each call checks
the Estimator's, builds, and wraps the spec for the task's session.
"""

import inspect
from typing import Callable, Optional, Sequence

import tensorflow as tf

# First: it refuses a TensorFlow other than 2.15 with the fix.
from replicate import _tf  # pylint: disable=unused-import
from replicate.communication import allreduce
from replicate import arguments
from replicate.cluster import ps_cluster
from replicate.towers import context as context_lib
from replicate.call import devices as devices_lib
from replicate.call import layout as layout_lib
from replicate.towers import report
from replicate.shard import rows_meet
from replicate.shard import batch_reductions
from replicate.shard import sharding
from replicate.outputs import specs as specs_lib
from replicate.outputs import tpu_spec
from replicate.gradients import touched
from replicate.variables import strategies
from replicate.batch_norm import sync_batch_norm as sync_batch_norm_lib
from replicate.variables import tower_variables as tower_variables_lib

Reduction = tf.compat.v1.losses.Reduction

def replicate_model_fn(
    model_fn: Callable,
    loss_reduction: str = Reduction.SUM_BY_NONZERO_WEIGHTS,
    devices: Optional[Sequence[str]] = None,
    variable_strategy: str = strategies.PARAMETER_SERVER,
    sync_batch_norm: bool = True,
    *,
    all_reduce: str = allreduce.AUTO,
    compact_gradients: bool = False) -> Callable:
  """Replicates `model_fn` over devices: one tower per device, one update.

  Args:
    model_fn: an Estimator `model_fn` whose optimizers are wrapped in
      `replicate.TowerOptimizer`.
    loss_reduction: how the `model_fn` reduces its loss over the batch.
      The default `SUM_BY_NONZERO_WEIGHTS` reads it from the graph, term by
      term (`replicate.gradients.loss_rule`): sums count as they are, means
      and ratios of sums by every tower's count, terms not from the rows
      once; a loss it cannot read is refused with the fix. `Reduction.SUM`
      or `MEAN` / `SUM_OVER_BATCH_SIZE` state it: a term the graph reads
      otherwise is refused, one it cannot read is weighted as stated (1, or
      the tower's share `n_i / n`). `Reduction.NONE` is an error: a loss
      must be a scalar.
    devices: device strings, e.g. `['/gpu:0', '/gpu:1']`. None: every local
      GPU, or with no GPU every local CPU device, counted with the
      Estimator's `session_config` (so `ConfigProto(device_count={'CPU': 4})`
      gives 4 towers on a CPU-only machine).
    variable_strategy: where variables live. `"parameter_server"`: on the one
      device, or with several on `/device:CPU:0`. `"round_robin"`: on the
      tower devices in turn, in creation order. `"replicated"`: each tower
      trains its own copy of every variable on its own device; gradients
      are all-reduced and every copy gets the same update (see below).
    sync_batch_norm: True (the default): every batch norm in training
      mode normalizes with the whole batch's moments, as on one device, or
      the call is refused with the fix (see below). False, only when asked
      for: each tower's with its own shard's moments, and each TRAIN call
      logs one INFO line naming the layers so normalized.
    all_reduce: keyword only. With `"replicated"`, how gradients are
      summed across towers: `"gather"` (on tower 0's device, copied back),
      `"ring"` (TensorFlow's collective all-reduce, `CollectiveReduceV2`),
      `"nccl"` (the same over NCCL, GPUs), or `"auto"` (NCCL on GPUs when
      TensorFlow has it, else `"gather"`). The session needs no setting
      for them. See `replicate.communication.allreduce` and
      `replicate.communication.collectives`.
    compact_gradients: keyword only. With `"replicated"`, cast float32
      gradients to float16 for the all-reduce and back after (half the
      traffic, float16 precision in the sum).

  Returns:
    A `model_fn(features, labels, mode, params=None, config=None)` for
    `tf.estimator.Estimator`.

  On sharding: features and labels are split along dimension 0, unevenly if
  needed (the first `n % N` towers get one extra row); towers left with no
  rows weigh 0. Tower 0 is built under the `model_fn`'s own names, towers
  1..N-1 under name scopes `tower_1`, ..., sharing tower 0's variables, so
  checkpoints are the unwrapped `model_fn`'s.

  On modes: TRAIN returns the whole batch's loss and a `train_op` that
  applies the summed gradients once per step; EVAL reports every metric over
  the whole batch (a metric fed a value over the batch, `metrics.mean(loss)`,
  is fed the whole batch's; one that cannot be combined, a `py_func` corpus
  score, is refused with the fix below); PREDICT concatenates predictions
  and export outputs in input order.

  On `TPUEstimatorSpec`: the `model_fn` may return one (as BERT's does with
  `use_tpu=False`); its `eval_metrics` metric_fn is called once, on the
  whole batch's tensors concatenated in input order, and its `scaffold_fn`
  once; an `EstimatorSpec` is returned, for `Estimator` and
  `TPUEstimator(use_tpu=False)` alike (see `replicate.outputs.tpu_spec`). A SavedModel's graph (PREDICT with features fed by
  placeholders, as `export_saved_model` builds, and the TRAIN and EVAL
  graphs of `experimental_export_all_saved_models`) is built as one tower
  with no device placement, so the SavedModel loads on any machine and
  serves any batch size.

  On clusters: with a `RunConfig` whose `TF_CONFIG` cluster has chief and
  worker tasks and no ps tasks, training is synchronous: with
  `variable_strategy="replicated"` (and `replicate.start_server` called
  first), every task builds one tower per device of its own server, and
  what one machine combines over its towers is summed across tasks too,
  so a step is one device's on the concatenation of every task's batch
  (see `replicate.cluster`). With ps tasks, each training task builds one
  tower per device of its own server, the variables go to the ps tasks in
  turn, and each worker sums its towers' gradients before sending one
  update (see `replicate.cluster.ps_cluster` and
  `replicate.cluster.session_hooks`).

  On batch norm: by default (`sync_batch_norm=True`), in TRAIN, every
  training-mode batch norm (`tf.compat.v1.layers.batch_normalization` and
  `tf.keras.layers.BatchNormalization`, fused or not, its moving-average
  updates through `UPDATE_OPS`, the layer's `updates` or control
  dependencies of its output) normalizes with the whole batch's mean and
  variance, combined from the towers' by their row counts, and its
  gradient through them is summed over towers, so the loss, the gradients,
  every variable and the moving statistics are one device's on the whole
  batch (see `replicate.batch_norm.sync_batch_norm`). What cannot be
  synchronized is a `ValueError` naming the layer and the fix (often
  `sync_batch_norm=False`): a tensor `training` argument, batch norm
  inside a `tf.function`, Keras masks, `virtual_batch_size`, a gradient
  through it not made by `TowerOptimizer`, and a ps cluster of several
  training tasks (a synchronous cluster synchronizes across its tasks).
  A model without batch norm is never refused for it and builds the same
  graph either way; one tower, EVAL, PREDICT and export graphs are
  unchanged. With `sync_batch_norm=False` each tower normalizes with its
  own shard's moments (moving statistics still combined by the shares)
  and each TRAIN call logs one INFO line naming those layers; a Keras
  layer declared `synchronized=True` is synchronized either way.

  On `"replicated"`: in TRAIN, tower 0 creates the variables under their own
  names on its device, and tower i gets local copies named `tower_i/...` on
  its own, initialised from tower 0's values by the Scaffold's
  `local_init_op` (so also right after a restore). Only tower 0's variables
  (and its optimizer slots) are saved. Non-trainable variables, such as
  batch-norm moving statistics or a loss scale, are not copied: every
  tower uses tower 0's, as with `"parameter_server"`. EVAL and PREDICT
  read tower 0's variables in every tower, with no copies.

  Example:

  ```python
  config = tf.estimator.RunConfig(session_config=tf.compat.v1.ConfigProto(
      device_count={"CPU": 2}))  # two towers on a CPU-only machine
  estimator = tf.estimator.Estimator(
      model_fn=replicate.replicate_model_fn(model_fn), config=config)
  estimator.train(input_fn, steps=100)
  ```
  """
  fixed_devices, model_fn_args = arguments.check_all(
      model_fn, loss_reduction, devices, variable_strategy, sync_batch_norm,
      all_reduce, compact_gradients)

  def build(features, labels, mode, params, config):
    # Check: the Estimator's arguments, the cluster.
    kwargs = arguments.model_fn_kwargs(model_fn, model_fn_args, labels, mode,
                                       params, config)
    if arguments.is_export_graph(mode, features):
      return tpu_spec.as_estimator_spec(model_fn(features=features, **kwargs))
    batch_norm_sync = sync_batch_norm_lib.check_cluster(sync_batch_norm,
                                                        config, mode)
    strategies.check_cluster(variable_strategy, config, mode)
    # Build: the towers on their devices, with the strategy.
    tower_devices = strategies.tower_devices(fixed_devices, config, mode)
    strategy = strategies.for_call(variable_strategy, tower_devices, config,
                                   mode, all_reduce, compact_gradients)
    report.log_towers(tower_devices, variable_strategy, mode,
                      config if fixed_devices is None and
                      not ps_cluster.num_ps_tasks(config, mode) else None)
    if not strategy.builds_towers(len(tower_devices)):
      # Placed as a tower, so that in a cluster the variables still go to
      # the ps tasks rather than following the one device.
      with tf.compat.v1.get_default_graph().device(
          devices_lib.tower_device_function(tower_devices[0],
                                            strategy.variable_device)):
        spec = tpu_spec.as_estimator_spec(
            model_fn(features=features, **kwargs))
    else:
      spec = _build_towers(model_fn, features, labels, mode, kwargs,
                           tower_devices, loss_reduction, strategy,
                           batch_norm_sync)
    # Wrap: what the task's session needs around the one spec.
    return strategy.for_session(spec, config, mode)

  def replicated_model_fn(features, labels, mode, params=None, config=None):
    return build(features, labels, mode, params, config)

  if "params" not in model_fn_args:
    # The Estimator reads the signature to decide what to pass, and warns
    # about a model_fn that names `params` it was not given: it is shown
    # `params` only when the model_fn takes them. A caller may still pass
    # params=... (refused, unless empty, as before).
    signature = inspect.signature(replicated_model_fn)
    replicated_model_fn.__signature__ = signature.replace(parameters=[
        p for p in signature.parameters.values() if p.name != "params"])

  replicated_model_fn.__name__ = "replicated_" + getattr(
      model_fn, "__name__", "model_fn")
  return replicated_model_fn


def _build_towers(model_fn, features, labels, mode, kwargs, tower_devices,
                  loss_reduction, strategy: strategies.VariableStrategy,
                  batch_norm_sync):
  """Builds one tower per device and combines their specs.

  `strategy` (see `replicate.variables.strategies`) places the variables, says
  whether towers train their own copies, and combines their gradients.
  `batch_norm_sync(layout)` makes the call's batch-norm sites, or None.
  """
  num_towers = len(tower_devices)
  features, labels, task_rows = strategy.take_batch(features, labels)
  shards = sharding.split_batch(
      features, labels, num_towers,
      is_prediction=mode == tf.estimator.ModeKeys.PREDICT)
  if task_rows is None:
    task_rows = strategy.count_rows(shards.batch_size)
  device_functions = [
      devices_lib.tower_device_function(device, strategy.variable_device)
      for device in tower_devices
  ]
  layout = layout_lib.TowerLayout.of(tower_devices, device_functions,
                                     shards, strategy, task_rows=task_rows)
  with context_lib.replication_context(
      layout, loss_reduction, tower_variables=tower_variables_lib.TowerVariables(
          tf.compat.v1.get_default_graph(), tower_devices,
          is_replicated=layout.is_replicated,
          updates_shared=strategy.is_first_task),
      batch_norm=batch_norm_sync(layout)) as context, \
      sync_batch_norm_lib.swapped(context):
    tower_specs = []
    # A TPUEstimatorSpec's eval_metrics and scaffold_fn: called once.
    batch_calls = tpu_spec.BatchCalls()
    for tower in layout.towers:
      tower_kwargs = dict(kwargs)
      if "labels" in tower_kwargs:
        tower_kwargs["labels"] = tower.labels
      with context.tower_scope(tower.index):
        spec = batch_calls.tower_spec(
            model_fn(features=tower.features, **tower_kwargs), tower.index,
            context.progress.rows_of(tower.index))
      if not isinstance(spec, tf.estimator.EstimatorSpec):
        raise ValueError(
            "replicate_model_fn needs the model_fn to return a "
            "tf.estimator.EstimatorSpec or a "
            "tf.compat.v1.estimator.tpu.TPUEstimatorSpec; tower {} returned "
            "a {}.".format(tower.index, type(spec).__name__))
      tower_specs.append(spec)
    context.finish_towers()
    if context.batch_norm is not None:
      report.log_per_tower_batch_norm(context.batch_norm.per_tower_labels,
                                      num_towers)
    meeting = rows_meet.check(context, tower_specs[0],
                                batch_calls.whole_batch_ops())
    whole_values = batch_reductions.combine(
        layout, context.progress, tower_specs, mode,
        is_backward=touched.is_backward, mixed=meeting.mixed)
    with context.progress.building_own_ops():
      batch_calls.connect_batch(layout)
    return specs_lib.combine_specs(
        mode, tower_specs, layout=layout, progress=context.progress,
        records=context.records, weights=context.weights,
        variables=context.variables, whole_values=whole_values,
        meeting=meeting)
