"""The across-workers job's `probe` mode: bare collectives across tasks,
timed, no training (see `benchmarks/across_workers_job.py`)."""

import statistics
import time

import tensorflow as tf

# The fixed group key of the probe's collectives (its own processes, nothing
# else).
_PROBE_GROUP_KEY = 1


def probe(args, cluster, task, ranks, report):
  """Times bare cross-task all-reduces, one device per task; the chief
  gives `report` the medians."""
  sizes = [int(size) for size in args.probe_elements.split(",") if size]
  server_config = tf.compat.v1.ConfigProto(device_count={"CPU": 1})
  server_config.experimental.collective_group_leader = (
      "/job:chief/replica:0/task:0")
  server = tf.distribute.Server(tf.train.ClusterSpec(cluster),
                                job_name=task[0], task_index=task[1],
                                config=server_config)
  device = "/job:{}/replica:0/task:{}/device:CPU:0".format(*task)
  graph = tf.Graph()
  with graph.as_default(), tf.device(device):
    fetches = {"none": tf.constant(0.0) + 1.0}  # a run without a collective
    keys = iter(range(1, 10**6))

    def all_reduce(size, timeout=0.0):
      value = tf.ones([size], tf.float32) * float(ranks.index(task) + 1)
      return tf.raw_ops.CollectiveReduceV2(
          input=value, group_size=len(ranks), group_key=_PROBE_GROUP_KEY,
          instance_key=next(keys), ordering_token=[], merge_op="Add",
          final_op="Id", communication_hint="ring", timeout_seconds=timeout)

    def concurrent(timeout=0.0):
      """`--probe-concurrent` 1-element all-reduces in one run: what each
      further collective of a step costs when they run side by side."""
      return tf.math.add_n([all_reduce(1, timeout)[0] for _ in range(
          args.probe_concurrent)]) / float(args.probe_concurrent)

    for size in sizes:
      fetches[str(size)] = all_reduce(size)[0]  # one element, not the sum
    fetches["{}x1".format(args.probe_concurrent)] = concurrent()
    if args.probe_timeout:
      # With an op timeout, as replicate's collectives have: TensorFlow
      # 2.15 then starts a thread per collective that sleeps for the
      # timeout (tensorflow/tensorflow#62466), so keep it short here.
      fetches["1 timed"] = all_reduce(1, args.probe_timeout)[0]
      fetches["{}x1 timed".format(args.probe_concurrent)] = concurrent(
          args.probe_timeout)
  session = tf.compat.v1.Session(
      server.target, graph=graph, config=tf.compat.v1.ConfigProto(
          device_filters=["/job:{}/task:{}".format(*task)]))
  expected = sum(range(1, len(ranks) + 1))
  times = {name: [] for name in fetches}
  # Every task runs the same collectives in the same order (their step ids
  # come from the leader); the first rounds form the group and warm up.
  for round_index in range(args.probe_rounds + 10):
    for name, fetch in fetches.items():
      start = time.perf_counter()
      value = session.run(fetch)
      elapsed = time.perf_counter() - start
      if name != "none" and value != expected:
        raise RuntimeError("The all-reduce of {} elements gave {}, not "
                           "{}.".format(name, value, expected))
      if round_index >= 10:
        times[name].append(elapsed)
  if task == ("chief", 0):
    report({"mode": "probe", "tasks": len(ranks),
             "rounds": args.probe_rounds,
             "concurrent": args.probe_concurrent,
             "timeout": args.probe_timeout, "threads": threads(),
             "median_ms": {name: 1000 * statistics.median(values)
                           for name, values in times.items()}})
  return 0


def threads():
  """This process's threads (Linux), or None."""
  try:
    with open("/proc/self/status") as status:
      for line in status:
        if line.startswith("Threads:"):
          return int(line.split()[1])
  except OSError:
    pass
  return None
