"""Tests of `benchmarks/`: configurations, arithmetic, pipelines, the figures
of docs/benchmarks.md, the command lines.

Fast: nothing here trains or times a model. The figures test is the check
that docs/benchmarks.md's figures are RESULTS.md's.
"""

import re
import struct
from typing import NamedTuple

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import step_stats_pb2

from benchmarks import __main__ as main
from benchmarks import (across_workers, across_workers_cost,
                        across_workers_ctr, across_workers_ctr_report,
                        across_workers_report,
                        allreduce_cost, cluster, configs, ctr_cost,
                        ctr_model, harness, pipelines, plot, profile, readme,
                        report, results_md, split_cost, step_cost_model)
from benchmarks.models import MODELS


class _Run(NamedTuple):
  examples_per_second: float
  window_examples_per_second: float


def test_readme_figures_are_results_md():
  with open(readme.RESULTS) as results:
    block = readme.render(results.read())
  with open(readme.README) as text:
    assert block in text.read(), (
        "docs/benchmarks.md's figures are not benchmarks/RESULTS.md's; "
        "run python -m benchmarks.readme")


def test_readme_parses_results_tables_and_aa_lines():
  results = "\n".join([
      "# Benchmark results", "Command: `python -m benchmarks --quick`  ",
      "Date: 2026-01-02", "",
      "A/A, mlp: single-again / single 1.01 (0.99-1.02) over 3 repeats  ",
      "", "## mlp: MLP, global batch 256", "",
      "| config | x single | x static | build s |", "|---|---|---|---|",
      "| replicate-2-ps | 0.95 (0.93-0.97) | 0.98 (0.97-0.99) | 0.10 |",
      "| mirrored-2-r1d | 0.80 (0.78-0.81) | - | 0.08 |", "",
      "### wide: another run's section", "",
      "| config | x single |", "|---|---|", "| replicate-2-ps | 0.50 |"])
  tables = readme.parse(results)
  assert set(tables) == {"mlp"}
  assert tables["mlp"]["replicate-2-ps"]["x static"] == "0.98 (0.97-0.99)"
  block = readme.render(results)
  assert "| mlp | 2 | 0.95 (0.93-0.97) | 0.98 (0.97-0.99) |" in block
  assert "A/A, mlp: single-again / single 1.01 (0.99-1.02)" in block
  # 0.10 s >= 0.08 s: the one cell is not below MirroredStrategy's.
  assert "in 0 of 1 cells; not in: mlp ps at N = 2" in block


def test_readme_without_markers_is_refused():
  with pytest.raises(ValueError, match="no generated block"):
    readme.replace_block("# README\n", "block")


@pytest.mark.parametrize("name, expected", [
    ("single", configs.Config("single", "single", 1, "")),
    ("single-again", configs.Config("single-again", "single", 1, "",
                                    "dynamic", True)),
    ("replicate-4-ps-static", configs.Config(
        "replicate-4-ps-static", "replicate", 4, "ps", "static")),
    ("mirrored-2-r1d-static-again", configs.Config(
        "mirrored-2-r1d-static-again", "mirrored", 2, "r1d", "static",
        True)),
])
def test_parse_config(name, expected):
  assert configs.parse_config(name) == expected


def test_an_aa_twin_measures_its_namesake():
  config = configs.parse_config("replicate-2-ps-static-again")
  assert config.measured == "replicate-2-ps-static"


@pytest.mark.parametrize("name, message", [
    ("replicate-2", "Unknown configuration 'replicate-2'"),
    ("single-again-static", "Unknown configuration"),  # -static comes first
    ("mirrored-2-nccl", "Unknown configuration"),
    ("replicate-0-ps", "asks for 0 towers; use 1 or more"),
])
def test_parse_config_errors(name, message):
  with pytest.raises(ValueError, match=message):
    configs.parse_config(name)


def test_a_configuration_named_twice_is_refused(capsys):
  with pytest.raises(SystemExit):
    main._parse_args(["--configs", "single,single"])
  assert "add it again with -again" in capsys.readouterr().err


def test_default_grid_has_static_twins_and_aa():
  configs = main._default_configs([1, 2, 4, 8], is_quick=False)
  for name in ("single-static", "single-again", "replicate-1-ps-static",
               "replicate-8-ps-static", "replicate-8-handring",
               "mirrored-8-r1d"):
    assert name in configs
  assert len(configs) == len(set(configs)) == 29  # 5 at N = 1, 8 per N > 1
  quick = main._default_configs([1, 2, 4], is_quick=True)
  assert "replicate-2-gather" not in quick and "single-again" in quick


def test_a_sync_configuration_passes_sync_batch_norm():
  config = configs.parse_config("replicate-4-rr-sync-static-again")
  assert config == configs.Config(
      "replicate-4-rr-sync-static-again", "replicate", 4, "rr", "static",
      True, sync_batch_norm=True)
  assert config.replicate_arguments == {"variable_strategy": "round_robin",
                                        "sync_batch_norm": True}
  assert configs.parse_config("replicate-2-ps").replicate_arguments == {
      "variable_strategy": "parameter_server", "sync_batch_norm": False}
  for name in ("single-sync", "mirrored-2-default-sync",
               "replicate-2-ps-static-sync"):
    with pytest.raises(ValueError, match="Unknown configuration"):
      configs.parse_config(name)


def test_a_sync_configuration_is_compared_with_per_tower_batch_norm():
  by_config = {"replicate-2-ps": [_Run(100.0, 100.0)],
               "replicate-2-ps-sync": [_Run(80.0, 80.0)],
               "replicate-2-rr": [_Run(90.0, 90.0)],
               "replicate-2-rr-sync": [_Run(45.0, 45.0)]}
  reference = lambda name: report._parameter_server(  # pylint: disable=protected-access
      by_config, configs.parse_config(name))
  assert reference("replicate-2-ps-sync") is by_config["replicate-2-ps"]
  assert reference("replicate-2-rr-sync") is by_config["replicate-2-rr"]
  assert reference("replicate-2-ps") is None
  assert configs.parse_config("replicate-2-ps-sync-static-again").family == (
      "replicate-ps-sync")
  assert configs.parse_config("mirrored-4-r1d").family == "mirrored-r1d"
  assert configs.parse_config("single-static").family == "single"


def test_the_default_models_are_results_mds():
  args = main._parse_args([])
  assert args.models == ["mlp", "wide", "convnet", "dnn_classifier"]
  assert {"bn_convnet", "bn_convnet_plain"} <= set(MODELS)


def test_paired_ratios_and_spread():
  runs = [_Run(90.0, 88.0), _Run(120.0, 110.0), _Run(50.0, 60.0)]
  reference = [_Run(100.0, 100.0), _Run(100.0, 100.0), _Run(50.0, 50.0)]
  # 90/100, 120/100, 50/50
  ratios = report.paired_ratios(runs, reference)
  assert ratios == pytest.approx([0.9, 1.2, 1.0])
  assert report.spread_text(ratios) == "1.00 (0.90-1.20)"
  assert report.spread(ratios) == pytest.approx(0.3)  # 1.2 - 0.9
  window = report.paired_ratios(runs, reference, "window_examples_per_second")
  assert window == pytest.approx([0.88, 1.1, 1.2])  # 88/100, 110/100, 60/50
  assert report.ratio_text(runs, None) == "-"


def test_aa_line():
  by_config = {"single": [_Run(100.0, 100.0), _Run(200.0, 200.0)],
               "single-again": [_Run(102.0, 95.0), _Run(198.0, 210.0)]}
  # trimmed: 1.02, 0.99 -> median 1.005, spread 0.03; window: 0.95, 1.05
  assert report.aa_line(by_config) == (
      "single-again / single 1.00 (0.99-1.02) over 2 repeats, spread 3.0%; "
      "by the whole window 1.00 (0.95-1.05), spread 10.0%")
  assert report.aa_line({"single": by_config["single"]}).startswith(
      "not measured")


def test_trimmed_rate_drops_the_slowest_tenth():
  # 9 steps of 10 ms and 256 rows, one of 5 ms and 65 rows (the partial
  # batch, kept), one spike of 100 ms (dropped: ceil(0.1 * 11) = 2 steps
  # dropped, the spike and one 10 ms step).
  durations = [0.010] * 9 + [0.005, 0.100]
  rows = [256] * 9 + [65, 256]
  # kept: 8 x 256 + 65 = 2113 rows in 8 x 0.010 + 0.005 = 0.085 s
  assert harness.trimmed_rate(rows, durations) == pytest.approx(2113 / 0.085)
  # Under 10 steps nothing is dropped: 512 rows in 0.03 s.
  assert harness.trimmed_rate([256, 256], [0.01, 0.02]) == pytest.approx(
      512 / 0.03)
  with pytest.raises(ValueError, match="as long as each other"):
    harness.trimmed_rate([256], [])


def test_failure_names_the_cause():
  error = tf.errors.InternalError(None, None, (
      "Graph execution error:\n\nDetected at node 'x' defined at (most "
      "recent call last):\n  File \"<frozen runpy>\", line 198, in main\n"
      "Node: 'x'\nCollective ops is aborted by: Shape mismatch | here\n"
      "more"))
  assert harness.failure(error) == (
      "Collective ops is aborted by: Shape mismatch / here")


@pytest.mark.parametrize("model", list(MODELS))
def test_dynamic_pipeline_has_a_partial_batch_and_no_static_batch(model):
  spec = MODELS[model]
  batch, rows = spec.global_batch, pipelines.dataset_rows(spec.global_batch)
  dataset = spec.make_input_fn("dynamic", batch)()
  for tensor_spec in tf.nest.flatten(dataset.element_spec):
    assert tensor_spec.shape[0] is None
  epoch = rows // batch + 1
  sizes = [int(labels.shape[0]) for _, labels in dataset.take(epoch + 1)]
  # 20 full batches, the remainder (a quarter and one row), then a full one.
  assert sizes == [batch] * 20 + [batch // 4 + 1, batch]
  assert sizes == pipelines.rows_per_step("dynamic", rows, batch, 1, 0,
                                          epoch + 1)


def test_static_pipeline_has_the_batch_in_its_shape():
  spec = MODELS["dnn_classifier"]
  dataset = spec.make_input_fn("static", 32)()
  features, labels = dataset.element_spec
  assert labels.shape == [32] and features["x"].shape == [32, 784]
  assert features["city"].shape == [32, 1]  # parsed once, ahead


def test_rows_per_step_under_mirrored_strategy():
  # 100 rows in batches of 16: 6 of 16 and one of 4 an epoch. Two replicas
  # take batches 0-1, 2-3, 4-5, then 6 (4 rows) and 7 (16, the next epoch).
  assert pipelines.rows_per_step("dynamic", 100, 16, 2, 0, 5) == [
      32, 32, 32, 20, 32]
  assert pipelines.rows_per_step("dynamic", 100, 16, 2, 3, 1) == [20]
  assert pipelines.rows_per_step("static", 100, 16, 2, 3, 2) == [32, 32]


def test_unknown_pipeline_is_refused():
  with pytest.raises(ValueError, match="Unknown pipeline 'streaming'"):
    pipelines.rows_per_step("streaming", 100, 16, 1, 0, 1)


def test_examples_parse_into_the_feature_columns_inputs():
  arrays = MODELS["dnn_classifier"].make_arrays(3, np.random.RandomState(0))
  parsed = MODELS["dnn_classifier"].parse(arrays["serialized"])
  assert parsed["x"].shape == [3, 784] and parsed["age"].shape == [3, 1]
  assert parsed["city"].dtype == tf.string


def test_profile_adds_op_time_by_kernel_type():
  step_stats = tf.compat.v1.RunMetadata().step_stats
  for device, nodes in (("CPU:0", [
      ("[mklcpu 1.0MB 1.0MB] dense/Relu = _MklNativeFusedMatMul(x, w)", 300),
      ("sum = AddN(a, b)", 40), ("_SOURCE", 7)]),
                        ("CPU:1", [("sum_1 = AddN(c, d)", 60)])):
    stats = step_stats.dev_stats.add(device=device)
    for label, micros in nodes:
      stats.node_stats.add(timeline_label=label, all_end_rel_micros=micros)
  tracer = profile._Tracer(warmup=0, timed=0, traced=1)
  tracer._add(step_stats)  # pylint: disable=protected-access
  # both devices' AddNs: 40 + 60 us; _SOURCE ran no kernel
  assert tracer.micros == {"_MklNativeFusedMatMul": 300, "AddN": 100}
  assert tracer.counts == {"_MklNativeFusedMatMul": 1, "AddN": 2}


def test_profile_table_says_what_a_configuration_adds():
  single = profile.Profile(100, 9.5, {"MatMul": 8.0, "AddN": 0.5},
                           {"MatMul": 5, "AddN": 1})
  towers = profile.Profile(300, 10.0, {"MatMul": 8.2, "AddN": 1.1,
                                       "Switch": 0.05},
                           {"MatMul": 10, "AddN": 7, "Switch": 14})
  text = profile.markdown("mlp", {"single": single, "replicate-2-ps": towers},
                          top=2)
  # op time 9.35 - 8.5 = +0.85 ms, step 10.0 - 9.5 = +0.5 ms; largest
  # changes first: AddN +0.6 (6 more ops), MatMul +0.2 (5 more ops)
  assert ("What replicate-2-ps adds to single: +0.85 ms of op time and "
          "+0.50 ms of step time.") in text
  assert "| AddN | +0.600 | +6 |\n| MatMul | +0.200 | +5 |" in text
  assert "Switch | +" not in text  # third largest, past top=2


def test_split_cost_times_the_same_products_on_slices():
  session, fetches = split_cost._graph(  # pylint: disable=protected-access
      [1, 2], batch=4, inputs=3, units=2)
  with session:
    with session.graph.as_default():
      weights, rows, upstream = session.run(
          tf.compat.v1.global_variables())
    per_slice, summed = session.run([fetches[(2, False)],
                                     fetches[(2, True)]])
  # N = 2: slices of rows 0-1 and 2-3; each slice's first output, plus the
  # weight gradients' first element, summed per slice or after the add_n:
  # the same number, and dw_0 + dw_1 is the whole batch's x^T dy.
  outputs = (rows[0] @ weights)[0] + (rows[2] @ weights)[0]
  assert per_slice == pytest.approx(outputs + (rows.T @ upstream)[0, 0],
                                    rel=1e-5)
  assert summed == pytest.approx(per_slice, rel=1e-5)


@pytest.mark.parametrize("module, argv, message", [
    (profile, ["--traced", "0"], "argument --traced: must be a whole number "
     "of at least 1; received '0'"),
    (split_cost, ["--towers", "2,4"], "argument --towers: must include 1 "
     "(the reference)"),
    (split_cost, ["--towers", "1,3"], "divide --batch (256) evenly; got 1,3"),
    (split_cost, ["--rounds", "0"], "argument --rounds: must be a whole "
     "number of at least 1; received '0'"),
])
def test_profile_and_split_cost_refuse_bad_arguments(module, argv, message,
                                                      capsys):
  with pytest.raises(SystemExit) as exit_info:
    module.main(argv)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


PARSERS = {"benchmarks": main.make_parser,
           "allreduce_cost": allreduce_cost.make_parser,
           "split_cost": split_cost.make_parser,
           "profile": profile.make_parser, "cluster": cluster.make_parser,
           "plot": plot.make_parser,
           "across_workers": across_workers.make_parser,
           "ctr_cost": ctr_cost.make_parser}


@pytest.mark.parametrize("name, argv, flag, message", [
    ("benchmarks", ["--towers", "two"], "--towers",
     "must be a whole number of at least 1; received 'two'"),
    ("benchmarks", ["--towers", "1,0"], "--towers", "received '0'"),
    ("benchmarks", ["--towers", "2,2"], "--towers", "names '2' twice"),
    ("benchmarks", ["--towers", ","], "--towers", "at least one value"),
    ("benchmarks", ["--models", "mlp,resnet"], "--models",
     "Unknown model 'resnet'; the models are: mlp, wide"),
    ("benchmarks", ["--configs", "single,replicate-2"], "--configs",
     "Unknown configuration 'replicate-2'; the forms are"),
    ("benchmarks", ["--configs", "single,single"], "--configs",
     "names 'single' twice; to measure one twice, add it again with -again"),
    ("benchmarks", ["--repeats", "0"], "--repeats", "at least 1"),
    ("benchmarks", ["--seconds", "-1"], "--seconds",
     "must be a number above 0; received '-1'"),
    ("benchmarks", ["--seconds", "nan"], "--seconds", "above 0"),
    ("benchmarks", ["--warmup", "2.5"], "--warmup", "received '2.5'"),
    ("allreduce_cost", ["--towers", "1,2"], "--towers",
     "must be a whole number of at least 2; received '1'"),
    ("allreduce_cost", ["--tensors", "1k,2k"], "--tensors",
     "unknown '2k'; choose from 1k, 100k, 1m, 4m, mlp"),
    ("allreduce_cost", ["--rounds", "many"], "--rounds", "received 'many'"),
    ("split_cost", ["--batch", "0"], "--batch", "at least 1"),
    ("split_cost", ["--towers", "1,2,2"], "--towers", "names '2' twice"),
    ("profile", ["--configs", "single,mirrored-2"], "--configs",
     "Unknown configuration 'mirrored-2'"),
    ("profile", ["--top", "-3"], "--top", "received '-3'"),
    ("cluster", ["--steps", "-5"], "--steps", "received '-5'"),
    ("across_workers", ["--tasks", "1,0"], "--tasks", "received '0'"),
    ("across_workers", ["--tasks", "2,2"], "--tasks", "names '2' twice"),
    ("across_workers", ["--approaches", "replicate,horovod"], "--approaches",
     "unknown 'horovod'; choose from replicate, mwms, ps-sync"),
    ("across_workers", ["--probe-tasks", "1"], "--probe-tasks",
     "must be a whole number of at least 2; received '1'"),
    ("across_workers", ["--steps", "0"], "--steps", "received '0'"),
    ("across_workers", ["--timeout", "0"], "--timeout",
     "must be a number above 0; received '0'"),
    ("ctr_cost", ["--unique", "1.5"], "--unique",
     "must be a fraction above 0 and at most 1; received '1.5'"),
    ("ctr_cost", ["--unique", "0"], "--unique", "received '0'"),
    ("ctr_cost", ["--ps", "0"], "--ps", "at least 1; received '0'"),
    ("ctr_cost", ["--compute-ms", "-2"], "--compute-ms", "above 0"),
])
def test_a_bad_value_is_a_usage_error_naming_its_flag(name, argv, flag,
                                                       message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    PARSERS[name]().parse_args(argv)
  assert exit_info.value.code == 2
  error = " ".join(capsys.readouterr().err.split())
  assert error.startswith("usage: ")
  assert "error: argument {}: ".format(flag) in error
  assert message in error


@pytest.mark.parametrize("name", list(PARSERS))
def test_every_flag_has_help_that_gives_its_default(name):
  parser = PARSERS[name]()
  formatter = parser.formatter_class(parser.prog)
  options = [action for action in parser._actions  # pylint: disable=protected-access
             if action.dest != "help"]
  assert options
  for action in options:
    assert action.help and action.help.strip(), action.dest
    shown = " ".join(formatter._format_action(action).split())  # pylint: disable=protected-access
    if action.nargs != 0:  # a flag's default is its absence
      assert "(default: " in shown, shown


def test_lists_parse_to_their_values():
  args = main._parse_args(["--towers", "1,2", "--models", "mlp,,wide",
                           "--seconds", "0.25"])
  assert args.models == ["mlp", "wide"] and args.seconds == 0.25
  assert "replicate-2-ps" in args.configs and not any(
      "-4-" in name for name in args.configs)
  assert allreduce_cost.make_parser().parse_args([]).towers == [2, 4, 8]
  assert [c.name for c in profile.make_parser().parse_args([]).configs] == [
      "single", "replicate-2-ps", "replicate-4-ps"]


def png_size(path):
  """(width, height) from a PNG's IHDR chunk."""
  with open(path, "rb") as image:
    header = image.read(24)
  assert header[:8] == b"\x89PNG\r\n\x1a\n" and header[12:16] == b"IHDR"
  return struct.unpack(">II", header[16:24])


def test_plot_redraws_both_figures_from_results_md_alone(tmp_path, capsys):
  assert plot.main(["--results", readme.RESULTS, "--output",
                    str(tmp_path)]) == 0
  assert "(4 models)" in capsys.readouterr().out
  for kind in ("examples_per_sec", "scaling"):
    width, height = png_size(tmp_path / "RESULTS_{}.png".format(kind))
    assert 1000 <= width <= 1600 and 0.8 <= width / height <= 1.8, (
        kind, width, height)  # a 2 x 2 grid, not a strip


def test_plot_reads_every_model_and_configuration_of_results_md():
  with open(readme.RESULTS) as results:
    text = results.read()
  panels, subtitle = plot.read_results(text)
  # Counted here without the parser: each `## model` section's table rows.
  expected, model = {}, None
  for line in text.splitlines():
    heading = re.match(r"^## (\w+): ", line)
    if heading:
      model = heading.group(1)
      expected[model] = set()
    elif line.startswith("#"):  # another section (## Across workers)
      model = None
    elif model and re.match(r"^\| [a-z]", line) and not line.startswith(
        "| config |"):
      expected[model].add(line.split("|")[1].strip())
  assert list(panels) == ["mlp", "wide", "convnet", "dnn_classifier"]
  assert {m: set(p.medians) | set(p.failed) for m, p in panels.items()} == (
      expected)
  assert all(len(names) == 29 for names in expected.values())
  mlp = panels["mlp"]
  assert mlp.title == "mlp: MLP 784-1024-1024-10, global batch 256"
  assert mlp.medians["replicate-2-ps"] == {
      "examples/sec": 26152.0, "step ms": 9.55, "build s": 0.16}
  assert panels["wide"].title.startswith("wide: 100,000 x 16 embedding")
  assert panels["dnn_classifier"].failed == ["mirrored-2-default",
                                             "mirrored-4-default"]
  assert subtitle == (
      "2 cores, x86_64, Python 3.11.7, TensorFlow 2.15.1, virtual CPU "
      "devices (no GPU); 2026-11-24, medians of 5 repeats")


def test_a_run_plots_the_medians_its_table_gives(monkeypatch):
  drawn = {}
  monkeypatch.setattr(plot, "draw", lambda *args: drawn.update(
      zip(("rates", "scaling", "panels", "subtitle"), args)))
  runs = [harness.Cell(rate, rate, build, step, 1.5, 100, 2.0)
          for rate, build, step in ((100.0, 0.5, 0.010), (300.0, 0.7, 0.030),
                                    (200.0, 0.6, 0.020))]
  report.plot("a.png", "b.png", {"mlp": {"single": runs}},
              {"mlp": {"mirrored-2-default": "Shape mismatch"}},
              [configs.parse_config("single"),
               configs.parse_config("mirrored-2-default")], "2 cores")
  panel = drawn["panels"]["mlp"]
  # The medians of 100/300/200, 10/30/20 ms and 0.5/0.7/0.6 s.
  assert panel.medians == {"single": {"examples/sec": 200.0, "step ms": 20.0,
                                      "build s": 0.6}}
  assert panel.failed == ["mirrored-2-default"]
  assert panel.title == "mlp: MLP 784-1024-1024-10, global batch 256"
  assert drawn["subtitle"].startswith("2 cores; ")
  assert drawn["subtitle"].endswith(", medians of 3 repeats")


@pytest.mark.parametrize("argv, message", [
    # 100 rows: 2 a tower at 1 task, 4 at 2, but not 6 at 3.
    (["--batch", "100"], "argument --batch: must divide evenly over every "
     "task count's towers (tasks x --towers 2); 100 does not for --tasks 3"),
    (["--redraw"], "argument --redraw: needs --record FILE"),
])
def test_across_workers_refuses_what_it_cannot_run(argv, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    across_workers.main(argv)
  assert exit_info.value.code == 2
  assert message in " ".join(capsys.readouterr().err.split())


def test_across_workers_defaults():
  args = across_workers.make_parser().parse_args([])
  assert args.tasks == [1, 2, 3] and args.repeats == 2
  assert args.approaches == ["replicate", "mwms", "ps-sync"]
  assert args.batch % 6 == 0  # 1, 2 and 3 tasks of 2 towers


def test_ring_all_reduce_sends_2_k_minus_1_over_k_of_the_bytes():
  ring = step_cost_model.ring_bytes_per_member
  assert ring(100.0, 1) == 0.0  # alone: nothing to send
  assert ring(100.0, 2) == pytest.approx(100.0)
  assert ring(100.0, 4) == pytest.approx(150.0)  # 2 x 3/4
  assert ring(100.0, 128) == pytest.approx(2 * 127 / 128 * 100.0)
  with pytest.raises(ValueError, match="at least 1 member"):
    ring(100.0, 0)


def test_the_cost_model_counts_parameters_and_collectives():
  resnet, norms = step_cost_model.resnet50_shapes()
  # torchvision's resnet50 (v1.5, no conv biases) has 25,557,032.
  assert step_cost_model.parameters(resnet) == 25_557_032
  assert norms == 53 and len(resnet) == 53 * 3 + 2
  counts = step_cost_model.replicate_collectives(resnet, 2 * norms)
  # 106 moving statistics, summed across tasks in one pack.
  assert counts["statistics"] == 1 and counts["packed gradients"] == 1
  assert sum(counts.values()) == 1 + counts["large gradients"] + 1 + 2
  # The MLP: 784x1024 + 1024 + 1024x1024 + 1024 + 1024x10 + 10; its two
  # large kernels have their own collectives, the rest share a pack (as
  # the replicate job's graph shows: 4 CollectiveReduceV2 with the loss).
  mlp = step_cost_model.mlp_shapes(784, [1024, 1024], 10)
  assert step_cost_model.parameters(mlp) == 1_863_690
  assert step_cost_model.replicate_collectives(mlp) == {
      "packed gradients": 1, "large gradients": 2, "statistics": 0,
      "loss": 1, "rows (all-gather)": 1}


def test_a_step_predicted_by_hand():
  model = step_cost_model
  arrangement = model.Arrangement("replicate", members=4, collectives=5,
                                  rounds=2)
  overhead = model.Overhead(first=0.001, more=0.0005)
  step = model.step(arrangement, gradient_bytes=100e6,
                    bandwidth=25 * model.GBIT_BYTES, hop_latency=25e-6,
                    overhead=overhead, compute=0.18)
  # 1.5 x 100 MB over 3.125 GB/s; 2 rounds x 6 hops x 25 us; 1 + 4 x 0.5 ms
  assert step.transfer == pytest.approx(0.048)
  assert step.latency == pytest.approx(0.0003)
  assert step.overhead == pytest.approx(0.003)
  assert step.no_overlap == pytest.approx(0.2313)
  assert step.efficiency_no_overlap == pytest.approx(0.18 / 0.2313)
  # forward (1/3 of 0.18 s) + 51.3 ms of communication < 0.18 s: hidden
  assert step.overlap == pytest.approx(0.18)
  slow = model.step(arrangement, 100e6, 1e9, 25e-6, overhead, 0.18)
  assert slow.overlap == pytest.approx(0.06 + 0.15 + 0.0033)
  alone = model.step(model.replicate_ring(1, 5), 100e6, 1e9, 25e-6,
                     overhead, 0.18)
  assert alone.communication == 0.0 and alone.efficiency_no_overlap == 1.0
  flat = model.flat_ring(2, 8, 100e6)  # 100 MB in 64 MiB buffers: 2
  assert (flat.members, flat.collectives, flat.rounds) == (16, 2, 2)


def _tiny_ctr(**changes):
  """10 rows x 2, 3 fields, 2 examples a worker: 6 ids, 3 distinct rows; a
  slice 4 x 2 + 8 = 16 B; an MLP 6-1 (7 parameters, 28 B); the table 80 B."""
  ctr = step_cost_model.Ctr(rows=10, dim=2, fields=3, batch=2, unique=0.5,
                            mlp=((6, 1), (1,)), compute=1.0, slots=1)
  return ctr._replace(**changes)


def test_ctr_traffic_by_hand_at_2_workers():
  model, ctr = step_cost_model, _tiny_ctr()
  assert (ctr.ids, ctr.touched, ctr.slice_bytes, ctr.table_bytes,
          ctr.mlp_bytes) == (6, 3, 16, 80, 28)
  # Dense: a 2-member ring sends 2 x 1/2 of table + MLP = 108 B each way;
  # the table, its slot and its dense gradient, the MLP's likewise.
  dense = model.all_dense(ctr, 2)
  assert (dense.sent, dense.received, dense.phases) == (108, 108, (108,))
  assert (dense.collectives, dense.rounds, dense.worker_memory) == (3, 2, 324)
  # All-gather: 1 other worker x 3 rows x 16 B, plus the MLP's 28 B; the
  # static cap pads to the 6 ids. Memory: table + slot 160, MLP x 3 84,
  # the 2 workers' 3 slices 96.
  gather = model.all_gather(ctr, 2, ctr.touched)
  assert (gather.sent, gather.received, gather.phases) == (76, 76, (76,))
  assert model.all_gather(ctr, 2, ctr.ids).sent == 6 * 16 + 28
  assert (gather.collectives, gather.rounds, gather.worker_memory) == (
      6, 3, 340)
  # Hybrid, 1 ps, straight: every id up, 6 x 8 = 48 (the lookups send
  # them all, as measured), a row down for each 6 x 8 = 48, the 3 distinct
  # rows' slices 48 out. The ps takes both workers' ids (96) and slices
  # (96): its link is the busiest, 192 B in.
  straight = model.hybrid(ctr, 2, 1, gathered=False)
  assert (straight.sent, straight.received) == (48 + 48 + 28, 48 + 28)
  assert straight.phases == (96, 96, 96)
  assert (straight.busiest, straight.busiest_bytes) == ("a ps", 192)
  assert (straight.worker_memory, straight.ps_memory) == (84 + 96, 160 + 96)
  # Gathered: the workers all-gather their slices (48 + the MLP's 28),
  # then the chief pushes both workers' 96 B to the ps.
  gathered = model.hybrid(ctr, 2, 1, gathered=True)
  assert (gathered.sent, gathered.received) == (48 + 76, 48 + 76)
  assert gathered.phases == (96, 96, 76, 96)
  assert (gathered.busiest, gathered.busiest_bytes) == ("the chief", 220)
  assert (gathered.collectives, gathered.rounds) == (7, 4)
  # Half the workers' rows on each of 2 ps: the ps links carry half.
  assert model.hybrid(ctr, 2, 2, gathered=False).phases == (48, 48, 76)


def test_a_ctr_step_predicted_by_hand():
  model, ctr = step_cost_model, _tiny_ctr()
  overhead = model.Overhead(first=0.01, more=0.002)
  dense = model.ctr_step(model.all_dense(ctr, 2), 2, 100.0, 0.001, overhead,
                         ctr.compute)
  # 108 B at 100 B/s; 2 rounds x 2 hops; 0.01 + 2 further collectives.
  assert dense.transfer == pytest.approx(1.08)
  assert dense.latency == pytest.approx(0.004)
  assert dense.overhead == pytest.approx(0.014)
  assert dense.step == pytest.approx(2.098)
  assert dense.efficiency == pytest.approx(1 / 2.098)
  straight = model.ctr_step(model.hybrid(ctr, 2, 1, gathered=False), 2,
                            100.0, 0.001, overhead, ctr.compute)
  # 288 B in 3 phases; 3 rounds x 2 hops + 2 exchanges x 2 hops; 4
  # collectives and 2 ps transfers: 0.01 + 5 x 0.002.
  assert straight.transfer == pytest.approx(2.88)
  assert straight.latency == pytest.approx(0.010)
  assert straight.overhead == pytest.approx(0.020)
  alone = model.ctr_step(model.all_gather(ctr, 1, 3), 1, 100.0, 0.001,
                         overhead, ctr.compute)
  assert alone.step == 1.0 and alone.efficiency == 1.0


def test_sparse_bytes_grow_with_rows_touched_and_dense_with_the_table():
  model, small = step_cost_model, _tiny_ctr()
  big = small._replace(rows=1_000_010)
  for scheme in (lambda c: model.all_gather(c, 4, c.touched),
                 lambda c: model.hybrid(c, 4, 2, gathered=False),
                 lambda c: model.hybrid(c, 4, 2, gathered=True)):
    assert scheme(big).sent == scheme(small).sent
    assert scheme(big).phases == scheme(small).phases
  # 100,000 times the table: 2 x 3/4 x 4 x 2 x 1,000,000 B more a worker.
  assert model.all_dense(big, 4).sent - model.all_dense(small, 4).sent == (
      pytest.approx(12e6))
  # Twice the distinct rows: twice the slices, (4 - 1) x 3 x 16 B more.
  more = small._replace(unique=1.0)
  assert model.all_gather(more, 4, more.touched).sent - model.all_gather(
      small, 4, small.touched).sent == 3 * 3 * 16
  assert model.all_gather(more, 4, more.ids).sent == model.all_gather(
      small, 4, small.ids).sent  # the static cap does not see them


def test_ctr_cost_at_100m_rows_and_16_workers():
  ctr = ctr_cost.ctr_model()
  assert (ctr.ids, ctr.touched, ctr.table_bytes) == (106_496, 53_248, 6.4e9)
  found = {(r["traffic"].scheme, r["link"]): r for r in ctr_cost.rows(
      ctr, step_cost_model.Overhead(0.0, 0.0))}
  # 2 x 15/16 x (6.4 GB + the MLP's 4.39 MB) over 3.125 GB/s
  dense = found[("all-dense", 25)]
  assert dense["traffic"].sent == pytest.approx(
      1.875 * (6.4e9 + 1_096_705 * 4))
  assert dense["step"].transfer == pytest.approx(
      dense["traffic"].sent / 3.125e9)
  # 15 x 53,248 x 72 B + the MLP's ring share
  gather = found[("all-gather (distinct rows)", 100)]["traffic"]
  assert gather.sent == pytest.approx(15 * 53_248 * 72 + 1.875 * 4_386_820)
  # The hybrid's worker holds no table; its ps a quarter of table + slot.
  straight = found[("hybrid (straight)", 25)]
  assert straight["traffic"].worker_memory < 1e8
  assert straight["traffic"].ps_memory == pytest.approx(
      3.2e9 + 16 * 53_248 * 72 / 4)
  ranked = sorted(found.values(), key=lambda r: r["step"].step)
  assert ranked[-1]["traffic"].scheme == "all-dense"
  assert ranked[0]["traffic"].scheme == "hybrid (straight)"


def test_results_md_holds_the_ctr_section_the_model_gives():
  with open(readme.RESULTS) as results:
    text = results.read()
  probe = across_workers_cost.probe_figures(
      results_md.read_data(text, across_workers_cost.DATA)["probes"]["2"])
  section = "\n".join(ctr_cost.section(probe["untimed"]))
  assert section in text, ("RESULTS.md's CTR section is not the model's; "
                           "run python -m benchmarks.across_workers "
                           "--redraw --record benchmarks/RESULTS.md")
  assert section.startswith(ctr_cost.HEADING + "\n")
  assert "| hybrid (straight) | 100 Gb/s |" in section


def test_docs_quote_the_ctr_sections_efficiencies():
  with open(readme.RESULTS) as results:
    probe = across_workers_cost.probe_figures(results_md.read_data(
        results.read(), across_workers_cost.DATA)["probes"]["2"])
  sentence = ctr_cost.summary(ctr_cost.rows(ctr_cost.ctr_model(),
                                            probe["untimed"]))
  with open(readme.README) as text:
    assert sentence in " ".join(text.read().split()), (
        "docs/benchmarks.md does not quote RESULTS.md's CTR efficiencies: "
        + sentence)


def test_ctr_cost_prints_its_section(capsys):
  assert ctr_cost.main(["--workers", "2", "--ps", "1", "--unique", "1"]) == 0
  out = capsys.readouterr().out
  assert out.startswith(ctr_cost.HEADING)
  assert "K = 2 workers" in out and "P = 1 ps tasks" in out


def _across_workers_data():
  """A recorded run's figures: 1 and 2 tasks, 2 repeats, one failure."""
  def run(seconds, collectives=None, threads=None):
    return {"global_steps": 100, "seconds": seconds,
            "collectives": collectives or {}, "threads": threads}

  reduce_count = {"CollectiveGatherV2": 2, "CollectiveReduceV2": 4}
  return {
      "command": "python -m benchmarks.across_workers --tasks 1,2",
      "machine": "2 cores", "date": "2026-01-02", "batch": 384,
      "hidden": [1024, 1024], "towers": 2, "steps": 100, "warmup": 20,
      "repeats": 2, "probe_rounds": 10,
      "cells": [["replicate", 1], ["replicate", 2], ["mwms", 1],
                ["mwms", 2]],
      "runs": {"replicate x1": [run(1.0), run(2.0)],
               "replicate x2": [run(4.0, reduce_count, 1200),
                                run(4.0, reduce_count, 1400)],
               "mwms x1": [run(1.0), run(1.0)],
               "mwms x2": [None, None]},
      "failures": {"mwms x2": "chief exited with 1: ValueError: no"},
      "probes": {"2": [{"tasks": 2, "threads": 150, "median_ms": {
          "none": 0.5, "1": 1.5, "262144": 2.5, "2097152": 10.5,
          "32x1": 32.5, "1 timed": 2.5, "32x1 timed": 33.5}}],
                 "3": [None]},
  }


def test_across_workers_section_tables_and_round_trip():
  data = _across_workers_data()
  text = across_workers_report.section(data)
  # 384 x 100 / 1 s and / 2 s: median 28,800 (19,200-38,400); x 1 task is
  # paired: 1/4 and 2/4.
  assert ("| replicate | 1 | 2 | 192 | 28,800 (19,200-38,400) | 15.0 "
          "(10.0-20.0) | - | - | - |") in text
  assert ("| replicate | 2 | 4 | 96 | 9,600 (9,600-9,600) | 40.0 (40.0-40.0) "
          "| 0.38 (0.25-0.50) | - | 1,300 (1,200-1,400) |") in text
  assert ("| mwms | 1 | 1 | 384 | 38,400 (38,400-38,400) | 10.0 (10.0-10.0) "
          "| - | 1.50 (1.00-2.00) | - |") in text
  assert "| mwms | 2 | 2 | 192 | failed: chief exited with 1" in text
  # Over 1,000 threads at the end: the section says why.
  assert "after 120 steps the replicate chief has 1,300-1,300 threads" in text
  # Probe: overhead 1.5 - 0.5 = 1 ms; each further (32.5 - 1.5) / 31 = 1
  # ms; timed 2.5 - 0.5 = 2 ms and (33.5 - 2.5) / 31 = 1 ms; 8 MiB over 2
  # tasks is 8 MiB a member in 9 ms: 932 MB/s.
  assert ("| 2 | 0.50 | 1.50 | 2.50 | 10.50 | 32.50 | 2.50 | 33.50 | 1.00 | "
          "1.00 | 2.00 | 1.00 | 932 | 150 |") in text
  assert "| 3 | failed |" in text
  data["notes"] = ["a hand-written remark."]
  data["runs"]["mwms x1"][0]["load"] = [1.5, 3.25]
  text = across_workers_report.section(data)
  assert "\nNote: a hand-written remark.\n" in text
  assert "load average was 1.5 to 3.2 around the runs" in text
  assert results_md.read_data(text, across_workers_cost.DATA) == data


def test_results_md_keeps_its_model_tables_beside_the_section():
  with open(readme.RESULTS) as results:
    original = results.read()
  new = across_workers_report.section(_across_workers_data())
  text = results_md.replace_section(original, new,
                                    across_workers_report.SECTION)
  assert readme.parse(text) == readme.parse(original)
  assert readme.render(text) == readme.render(original)
  assert plot.read_results(text) == plot.read_results(original)
  # Replacing again changes nothing; the next `## ` heading ends it.
  assert results_md.replace_section(text, new,
                                    across_workers_report.SECTION) == text
  later = text + "\n## another section\n\ntext\n"
  assert results_md.kept_section(
      later, across_workers_report.SECTION).strip() == new.strip()
  assert results_md.replace_section(
      "# Results\n", new,
      across_workers_report.SECTION) == ("# Results\n\n" + new.rstrip("\n") +
                                         "\n")


def test_recording_keeps_the_rest_of_the_file(tmp_path):
  path = tmp_path / "RESULTS.md"
  path.write_text("# Benchmark results\n\n## mlp: MLP\n\n| config |\n")
  across_workers_report.publish(str(path), _across_workers_data())
  text = path.read_text()
  assert text.startswith("# Benchmark results\n\n## mlp: MLP\n\n| config |")
  assert results_md.read_data(
      text, across_workers_cost.DATA) == _across_workers_data()
  assert across_workers.main(["--redraw", "--record", str(path)]) == 0
  assert path.read_text() == text


def test_a_title_names_its_model_once():
  # MODELS' descriptions of wide and convnet start with the model's name.
  assert report.title("wide") == (
      "wide: 100,000 x 16 embedding, 8 ids a row, global batch 256")
  assert report.title("convnet").startswith("convnet: 2 conv")
  for model in MODELS:
    assert not report.title(model).startswith(model + ": " + model), model


def _synthetic_cells():
  """Three repeats of single and replicate-2-ps on wide, with a spread."""
  def cell(rate, step, build):
    return harness.Cell(rate, rate, build, step, 1.5, 100, 2.0)

  return {"wide": {
      "single": [cell(100.0, 0.010, 0.5), cell(140.0, 0.008, 0.7),
                 cell(120.0, 0.009, 0.6)],
      "replicate-2-ps": [cell(90.0, 0.012, 0.9), cell(180.0, 0.006, 1.3),
                         cell(110.0, 0.010, 1.0)]}}


def test_a_fresh_run_plots_titles_without_the_model_twice(monkeypatch):
  drawn = {}
  monkeypatch.setattr(plot, "draw", lambda *args: drawn.update(
      zip(("rates", "scaling", "panels", "subtitle"), args)))
  report.plot("a.png", "b.png", _synthetic_cells(), {"wide": {}},
              [configs.parse_config("single"),
               configs.parse_config("replicate-2-ps")], "2 cores")
  panel = drawn["panels"]["wide"]
  assert panel.title == (
      "wide: 100,000 x 16 embedding, 8 ids a row, global batch 256")
  # min and max of 90/180/110 examples/sec, 12/6/10 ms, 0.9/1.3/1.0 s
  assert panel.ranges["replicate-2-ps"] == {
      "examples/sec": (90.0, 180.0), "step ms": (6.0, 12.0),
      "build s": (0.9, 1.3)}
  rates, scaling = plot.figures(drawn["panels"], drawn["subtitle"])
  titles = [axis.get_title() for axis in rates.get_axes()] + [
      cell.get_suptitle() for cell in scaling.subfigs]
  assert "wide: 100,000 x 16 embedding, 8 ids a row, global batch 256" in (
      titles)
  assert not any("wide: wide" in title for title in titles), titles
  _close(rates, scaling)


def _bars(axis):
  """{(tower, median): (low, high)} of an Axes' error bars, to 6 places."""
  from matplotlib.container import ErrorbarContainer  # pylint: disable=import-outside-toplevel
  bars = {}
  for container in axis.containers:
    if isinstance(container, ErrorbarContainer):
      line, _, (columns,) = container.lines
      for x, y, segment in zip(line.get_xdata(), line.get_ydata(),
                               columns.get_segments()):
        (_, low), (_, high) = segment
        bars[(int(x), round(float(y), 6))] = (round(float(low), 6),
                                              round(float(high), 6))
  return bars


def test_a_fresh_runs_plots_draw_the_repeats_range_as_error_bars(
    monkeypatch):
  drawn = {}
  monkeypatch.setattr(plot, "draw", lambda *args: drawn.update(
      zip(("rates", "scaling", "panels", "subtitle"), args)))
  report.plot("a.png", "b.png", _synthetic_cells(), {"wide": {}},
              [configs.parse_config("single"),
               configs.parse_config("replicate-2-ps")], "2 cores")
  rates, scaling = plot.figures(drawn["panels"], drawn["subtitle"])
  axis = rates.get_axes()[0]
  # replicate-2-ps at N = 2: median 110 examples/sec, its bar 90 to 180.
  assert _bars(axis) == {(2, 110.0): (90.0, 180.0)}
  # single: a band from 100 to 140 around its line at 120.
  bands = [patch.get_path().get_extents().transformed(
      patch.get_transform() - axis.transData) for patch in axis.patches]
  assert [(band.y0, band.y1) for band in bands] == [
      pytest.approx((100.0, 140.0))]
  step, build = scaling.subfigs[0].get_axes()[:2]
  assert _bars(step) == {(2, 10.0): (6.0, 12.0)}
  assert _bars(build) == {(2, 1.0): (0.9, 1.3)}
  # The legend says what the bars are.
  legend = [text.get_text() for text in rates.legends[0].get_texts()]
  assert plot.BARS in legend
  _close(rates, scaling)


def test_results_md_plots_its_examples_per_sec_range_as_error_bars():
  with open(readme.RESULTS) as results:
    panels, subtitle = plot.read_results(results.read())
  # RESULTS.md: | replicate-2-ps | 26,152 (25,460-27,122) | ... | 9.55 |
  assert panels["mlp"].ranges["replicate-2-ps"] == {
      "examples/sec": (25460.0, 27122.0)}
  rates, _ = plot.figures({"mlp": panels["mlp"]}, subtitle)
  bars = _bars(rates.get_axes()[0])
  assert bars[(2, 26152.0)] == (25460.0, 27122.0)
  _close(rates, _)


def _close(*figures):
  from matplotlib import pyplot  # pylint: disable=import-outside-toplevel
  for figure in figures:
    pyplot.close(figure)


class _Failing:
  """harness.run_cell's stand-in: TensorFlow's logging, then its error."""

  def __init__(self, message):
    self.message = message

  def __call__(self, *args):
    import os  # pylint: disable=import-outside-toplevel
    os.write(2, (
        "2026-11-27 02:45:37.123456: E tensorflow/core/common_runtime/"
        "base_collective_executor.cc:249] BaseCollectiveExecutor::"
        "StartAbort INTERNAL: Shape mismatch in the collective instance\n"
        "2026-11-27 02:45:37.123999: W tensorflow/core/kernels/"
        "data/a.cc:1] a warning\n"
        "E1127 02:45:37.124000 1 collective_ops.cc:1] Collective ops is "
        "aborted by: Shape mismatch\n").encode())
    raise tf.errors.InternalError(None, None, self.message)


def test_the_expected_failure_prints_one_line_without_tensorflows_errors(
    monkeypatch, capfd):
  monkeypatch.setattr(harness, "run_cell", _Failing(
      "Collective ops is aborted by: Shape mismatch in the collective "
      "instance 105. Op at device CPU:0 expected shape [238]"))
  config = configs.parse_config("mirrored-2-default")
  outcome = harness.attempt("dnn_classifier", config, 5, 0.5)
  assert outcome.as_expected and outcome.hidden == 2
  assert outcome.failure.startswith("Collective ops is aborted by: Shape")
  line = main.failed_line(outcome)
  assert line.startswith("failed as expected: MirroredStrategy's ")
  assert "2 TensorFlow error lines hidden" in line and "\n" not in line
  err = capfd.readouterr().err
  assert " E tensorflow" not in err and "E1127" not in err
  assert "W tensorflow/core/kernels/data/a.cc:1] a warning" in err  # kept


@pytest.mark.parametrize("model, name, message", [
    ("dnn_classifier", "mirrored-2-default", "Out of memory"),  # another
    ("mlp", "mirrored-2-default", "Shape mismatch in the collective "
     "instance 1"),  # not the cell that fails by design
])
def test_any_other_failure_keeps_every_line(model, name, message,
                                            monkeypatch, capfd):
  monkeypatch.setattr(harness, "run_cell", _Failing(message))
  outcome = harness.attempt(model, configs.parse_config(name), 5, 0.5)
  assert not outcome.as_expected and outcome.hidden == 0
  assert main.failed_line(outcome) == "failed: " + message
  err = capfd.readouterr().err
  assert " E tensorflow/core/common_runtime" in err and "E1127" in err


def test_the_quick_runs_length_is_said_one_way_everywhere(capsys):
  # A fresh clone's --quick run took 6 min 13 s; the estimate it prints,
  # its --help and docs/benchmarks.md all say about 6 minutes.
  assert main.QUICK_TAKES == "about 6 minutes on 2 cores"
  main.main(["--quick", "--estimate"])
  assert capsys.readouterr().out.rstrip().endswith(
      ": " + main.QUICK_TAKES + ".")
  parser = main.make_parser()
  assert main.QUICK_TAKES in " ".join(parser.format_help().split())
  with open(readme.README) as text:
    docs = " ".join(text.read().split())
  assert docs.count(main.QUICK_TAKES) == 2  # the command list, the prose
  assert "few minutes" not in docs and "about 5 minutes" not in docs


# --- across_workers --model ctr ---------------------------------------------


def _node(name, label, shape=None, dtype=1, requested=0):
  stats = step_stats_pb2.NodeExecStats(node_name=name, timeline_label=label)
  description = stats.output.add().tensor_description
  description.dtype = dtype
  for size in shape or []:
    description.shape.dim.add().size = size
  description.allocation_description.requested_bytes = requested
  return stats


def test_step_bytes_counts_collectives_and_cross_task_transfers():
  chief = "/job:chief/replica:0/task:0"
  ps = "/job:ps/replica:0/task:0/device:CPU:0"
  metadata = tf.compat.v1.RunMetadata()
  device = metadata.step_stats.dev_stats.add(device=chief + "/device:CPU:0")
  device.node_stats.extend([
      # An all-gather in a function (named only by its label), a [6, 16]
      # float32 output: 384 bytes; an all-reduce without a label, found by
      # the graph's types, [10] float32: 40; an int64 [2] gather: 16.
      _node("cond/CollectiveGatherV2",
            "cond/CollectiveGatherV2 = CollectiveGatherV2(x, y)", [6, 16]),
      _node("allreduce", "", [10]),
      _node("lengths", "lengths = CollectiveGatherV2(n)", [2], dtype=9),
      # Rows from the ps task: counted; from the chief's other device: not.
      _node("RecvTensor", "[0.1MB] [7.2Gb/s] edge_1_rows from {} to "
            "{}/device:CPU:0".format(ps, chief), requested=1000),
      _node("RecvTensor", "[1KB] edge_2_x from {0}/device:CPU:1 to "
            "{0}/device:CPU:0".format(chief), requested=5000),
      # The ids sent to the ps task, int64 [3]: 24 bytes.
      _node("ids", "ids = Unique(x)", [3], dtype=9),
      _node("MatMul", "MatMul = MatMul(a, b)", [100, 100]),
  ])
  # The ps task's own record of receiving the ids: not the chief's.
  metadata.step_stats.dev_stats.add(device=ps).node_stats.extend([
      _node("RecvTensor", "[1KB] edge_3_ids from {}/device:CPU:0 to "
            "{}".format(chief, ps), requested=24)])
  graph = metadata.partition_graphs.add()
  for name, inputs, sender, receiver in [
      ("send_ids", ["ids", "^MatMul"], chief + "/device:CPU:0", ps),
      ("send_local", ["MatMul"], chief + "/device:CPU:0",
       chief + "/device:CPU:1"),
      ("send_unknown", ["Const:1"], chief + "/device:CPU:0", ps),
      ("send_from_ps", ["rows"], ps, chief + "/device:CPU:0")]:
    node = graph.node.add(name=name, op="_Send", input=inputs)
    node.attr["send_device"].s = sender.encode()
    node.attr["recv_device"].s = receiver.encode()
  counted = ctr_model.step_bytes(metadata, {"allreduce":
                                            "CollectiveReduceV2"}, chief)
  assert counted == {"collectives": 384 + 40 + 16, "collective ops": 3,
                     "received": 1000, "sent": 24, "send/recv": 1024,
                     "transfers": 2, "unsized": 1}


def test_step_bytes_of_a_traced_step_of_a_tiny_graph():
  graph = tf.Graph()
  with graph.as_default():
    values = tf.ones([3, 4], tf.float32)
    summed = tf.raw_ops.CollectiveReduceV2(
        input=values, group_size=1, group_key=1, instance_key=1,
        ordering_token=[], merge_op="Add", final_op="Id")
    gathered = tf.raw_ops.CollectiveGatherV2(
        input=tf.ones([5], tf.int64), group_size=1, group_key=1,
        instance_key=2, ordering_token=[])
  metadata = tf.compat.v1.RunMetadata()
  with tf.compat.v1.Session(graph=graph) as session:
    session.run([summed, gathered], options=tf.compat.v1.RunOptions(
        trace_level=tf.compat.v1.RunOptions.FULL_TRACE),
                run_metadata=metadata)
  counted = ctr_model.step_bytes(
      metadata, {op.name: op.type for op in graph.get_operations()},
      "/job:localhost/replica:0/task:0")
  # 12 float32 and 5 int64, counted once each; nothing crossed tasks.
  assert counted == {"collectives": 48 + 40, "collective ops": 2,
                     "received": 0, "sent": 0, "send/recv": 0,
                     "transfers": 0, "unsized": 0}


def test_ctr_batches_are_power_law_ids_in_the_table_and_repeat_per_rank():
  assert ctr_model.table_rows(1048576, 26) == 40330  # 26 x 40,330 >= 1M
  assert ctr_model.field_names(3) == ["C1", "C2", "C3"]
  features, labels = ctr_model.batch(1, 512, 26, 40330)
  again, _ = ctr_model.batch(1, 512, 26, 40330)
  other, _ = ctr_model.batch(2, 512, 26, 40330)
  assert list(features) == ctr_model.field_names(26)
  assert labels.shape == (512, 1) and set(np.unique(labels)) <= {0.0, 1.0}
  for name, ids in features.items():
    assert ids.dtype == np.int64 and ids.shape == (512,)
    assert 0 <= ids.min() and ids.max() < 40330
    np.testing.assert_array_equal(ids, again[name])
    assert len(np.unique(ids)) < 512  # hot rows repeat
  assert any((features[n] != other[n]).any() for n in features)


def _ctr_data():
  def run(tasks, seconds, quarter, whole, memory=800.0):
    return {"tasks": tasks, "global_steps": 100, "seconds": seconds,
            "memory_mb": memory, "bytes": {
                **({"quarter": {"collectives": quarter[0],
                                "send/recv": quarter[1]}} if quarter else {}),
                "whole": {"collectives": whole[0], "send/recv": whole[1]}},
            "touched": {"quarter": {"rows": 192, "ids": 4992,
                                    "distinct": 2716},
                        "whole": {"rows": 768, "ids": 19968,
                                  "distinct": 8759}}}

  return {
      "command": "python -m benchmarks.across_workers --model ctr",
      "machine": "2 cores", "date": "2026-01-02", "batch": 1536,
      "hidden": [256, 128], "towers": 2, "steps": 100, "warmup": 10,
      "repeats": 1, "fields": 26, "table_rows": 1048576, "dim": 16,
      "shards": 2,
      "cells": [["replicate", 2], ["hybrid", 2], ["mwms", 2],
                ["ps-async", 2], ["ps-sync", 2]],
      "runs": {"replicate x2": [run(2, 8.0, (1_000_000, 0), (3_000_000, 0))],
               "hybrid x2": [run(2, 4.0, (800_000, 200_000),
                                 (3_000_000, 1_000_000), 500.0)],
               "mwms x2": [run(2, 2.0, None, (2_000_000, 0))],
               "ps-async x2": [run(2, 1.0, (0, 1_500_000), (0, 3_000_000))],
               "ps-sync x2": [None]},
      "failures": {"ps-sync x2": "chief exited with 1: ValueError: no"},
  }


def test_ctr_section_rates_bytes_and_round_trip():
  data = _ctr_data()
  data["runs"]["hybrid x2"][0]["bytes"]["whole"].update(
      {"collective ops": 161, "received": 400_000, "sent": 600_000})
  text = across_workers_ctr_report.section(data)
  # 1536 x 100 / 8 s = 19,200; 800,000 + 200,000 quarter bytes.
  assert ("| replicate | 2 | 0 | 4 | 384 | 19,200 | 80.0 | - | 1,000,000 | "
          "3,000,000 | 3,000,000 (-) / - / - | 800 |") in text
  assert ("| hybrid | 2 | 1 | 4 | 384 | 38,400 | 40.0 | 2.00 | 1,000,000 | "
          "4,000,000 | 3,000,000 (161) / 400,000 / 600,000 | 500 |") in text
  # MWMS: one device a task, no quarter step.
  assert ("| mwms | 2 | 0 | 2 | 768 | 76,800 | 20.0 | 4.00 | - | "
          "2,000,000 |") in text
  # ps-async: a global step is one task's 768 rows.
  assert "| ps-async | 2 | 1 | 4 | 384 | 76,800 | 10.0 | 4.00 |" in text
  assert "| ps-sync | 2 | 1 | 4 | 384 | failed: chief exited with 1" in text
  assert ("grow by: replicate: +2.00 MB (x 3.00) at 2 tasks; hybrid: +3.00 "
          "MB (x 4.00) at 2 tasks; ps-async: +1.50 MB (x 2.00) at 2 "
          "tasks.") in text
  # 416 x 256 + 256 + 256 x 128 + 128 + 128 + 1 floats.
  assert "dense layers' part (0.56 MB of gradients" in text
  # ps-async is not synchronous; the fastest first, then the next.
  assert ("Fastest synchronous approach (replicate, hybrid, mwms, ps-sync; "
          "median examples/sec): 2 tasks: mwms (76,800, then hybrid "
          "38,400).") in text
  assert "2 tasks: 768 rows look up 19,968 ids (8,759 distinct)" in text
  assert "40,330 x 16 (1,048,580 rows, 67.1 MB" in text
  assert results_md.read_data(text, across_workers_ctr_report.DATA) == data
  data["runs"]["mwms x2"][0]["wall"] = 30.4
  data["runs"]["hybrid x2"][0]["wall"] = 50.0
  assert ("; 1 repeat, the runs 80 s in all." in
          across_workers_ctr_report.section(data))
  assert results_md.read_data(
      text, across_workers_cost.DATA) is None  # not the MLP's figures


def test_the_ctr_section_sits_beside_the_mlp_section(tmp_path):
  with open(readme.RESULTS) as results:
    original = results.read()
  mlp = results_md.kept_section(original, across_workers_report.SECTION)
  path = tmp_path / "RESULTS.md"
  path.write_text(original)
  across_workers_ctr_report.publish(str(path), _ctr_data())
  text = path.read_text()
  assert results_md.kept_section(
      text, across_workers_report.SECTION).strip() == mlp.strip()
  # Recording the MLP's section again keeps the blank line before this one.
  again = results_md.replace_section(text, mlp, across_workers_report.SECTION)
  assert again == text
  assert "-->\n\n" + across_workers_ctr_report.SECTION in again
  assert results_md.read_data(text,
                              across_workers_cost.DATA) == results_md.read_data(
                                  original, across_workers_cost.DATA)
  assert readme.parse(text) == readme.parse(original)
  assert (tmp_path / "RESULTS_across_workers_ctr.png").exists()
  assert across_workers.main(["--model", "ctr", "--redraw", "--record",
                              str(path)]) == 0
  assert path.read_text() == text


def test_ctr_runs_have_their_own_defaults():
  parser = across_workers.make_parser()
  args = across_workers_ctr.with_defaults(
      parser.parse_args(["--model", "ctr", "--steps", "30"]),
      ["--model", "ctr", "--steps", "30"])
  assert args.tasks == [2, 3] and args.steps == 30 and args.repeats == 1
  assert args.approaches == ["replicate", "hybrid", "mwms", "ps-async",
                             "ps-sync"]
  assert args.batch % (4 * 2 * 2) == 0 and args.batch % (4 * 3 * 2) == 0


@pytest.mark.parametrize("argv, message", [
    (["--approaches", "replicate,hybrid"], "argument --approaches: hybrid "
     "run with --model ctr only"),
    (["--model", "ctr", "--batch", "1040"], "argument --batch: with --model "
     "ctr, a quarter of each task's rows must divide evenly over its towers "
     "(4 x tasks x --towers 2); 1040 does not for --tasks 3"),
    (["--model", "ctr", "--warmup", "5"], "argument --warmup: with --model "
     "ctr, must be above 7"),
])
def test_across_workers_ctr_refuses_what_it_cannot_run(argv, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    across_workers.main(argv)
  assert exit_info.value.code == 2
  assert message in " ".join(capsys.readouterr().err.split())
