"""The package's layout: floors, no import cycle; TensorFlow's private parts
in _tf.py.

Imports are read from the source (module level and inside functions), so a
cycle hidden behind a function-level import is found too.
"""

import ast
import pathlib
import re

import replicate

PACKAGE = pathlib.Path(replicate.__file__).parent


def _modules():
  """{dotted name: path} of every module of the package."""
  found = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    found[".".join(parts)] = path
  return found


def _imports(path, modules):
  """The package's modules that `path` imports, anywhere in it."""
  imported = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      # `from package import module` imports the module; `from module
      # import name` the module.
      names = [node.module + "." + alias.name for alias in node.names]
      if not any(name in modules for name in names):
        names = [node.module]
    else:
      continue
    imported.update(name for name in names if name in modules)
  return imported


def import_graph():
  """{module: the package's modules it imports}, leaving out its own
  packages (importing a module always imports those first)."""
  modules = _modules()
  graph = {}
  for name, path in modules.items():
    ancestors = {".".join(name.split(".")[:end])
                 for end in range(1, name.count(".") + 1)}
    graph[name] = _imports(path, modules) - {name} - ancestors
  return graph


def find_cycle(graph):
  """One import cycle as a list of modules (first repeated last), or []."""
  state = {}

  def visit(name, trail):
    state[name] = "open"
    for other in sorted(graph[name]):
      if state.get(other) == "open":
        return trail[trail.index(other):] + [other]
      if other not in state:
        cycle = visit(other, trail + [other])
        if cycle:
          return cycle
    state[name] = "done"
    return []

  for name in sorted(graph):
    if name not in state:
      cycle = visit(name, [name])
      if cycle:
        return cycle
  return []


def test_no_module_imports_itself_back():
  assert find_cycle(import_graph()) == []


# The floors, lowest first: a module may import its own floor's and the
# floors below, never one above. The bottom holds what every step uses (the
# call's bookkeeping, the strategy Protocol); the top runs the steps.
FLOORS = (
    # TensorFlow's private parts, walks, what op types mean (graph/).
    ("_tf", "graph_walk", "_identity", "graph"),
    ("call",),  # one call's context, layout, progress, devices, names
    ("shard",),  # step 1: the batch split, the rule of rows
    ("communication",),  # all-reduce, collectives
    ("cluster",),  # TF_CONFIG clusters, the launcher's processes
    ("gradients",),  # steps 3-4: weighting, combining, applying once
    ("variables",),  # where variables live, what a tower sees
    ("batch_norm",),  # sync_batch_norm
    ("towers",),  # step 2: building the model_fn once per tower
    ("state",),  # step 5: other state changes
    ("outputs",),  # step 6: the EstimatorSpec
    ("model_fn", "arguments", "canned", "launch", "check",
     ""),  # the wrapping, the API, the check against one device
)


def _floor_of(module):
  """The floor of `module` (a dotted name), from its first part below
  `replicate` ("" for the package itself)."""
  part = (module.split(".") + [""])[1]
  for level, names in enumerate(FLOORS):
    if part in names:
      return level
  raise AssertionError(
      "{} is on no floor: add its sub-package to FLOORS".format(module))


def sub_package_graph(graph):
  """{floor name: the other floor names its modules import}."""
  found = {}
  for module, imported in graph.items():
    part = (module.split(".") + [""])[1]
    found.setdefault(part, set()).update(
        (other.split(".") + [""])[1] for other in imported)
    found[part].discard(part)
  return found


def test_no_sub_package_imports_one_above_it():
  upward = sorted(
      (module, other) for module, imported in import_graph().items()
      for other in imported if _floor_of(other) > _floor_of(module))
  assert upward == []


def test_no_cycle_between_sub_packages():
  assert find_cycle(sub_package_graph(import_graph())) == []


def test_the_floors_hold_every_sub_package():
  parts = {(name.split(".") + [""])[1] for name in _modules()}
  assert parts == {name for names in FLOORS for name in names}


# Modules are kept under ~300 lines, one concern each; these are over it
# (`_tf.py` is the one room for TensorFlow's private parts). Any other over
# MAX_LINES fails; one brought under it leaves the list.
MAX_LINES = 300
LONG_MODULES = frozenset([
    "replicate._tf", "replicate.launch", "replicate.state.rule",
    "replicate.gradients.apply_once", "replicate.communication.allreduce",
    "replicate.outputs.batch_inputs", "replicate.shard.batch_reductions",
])


def test_the_long_modules_are_exactly_those_over_the_line_count():
  counts = {name: len(path.read_text().splitlines())
            for name, path in _modules().items()}
  assert sorted(name for name, lines in counts.items()
                if lines > MAX_LINES) == sorted(LONG_MODULES)


def test_the_cycle_finder_finds_a_cycle():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [
      "a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set()}) == []


# What reaching into TensorFlow looks like in a source: its private modules,
# Keras's, and the pylint switch for a private attribute.
_PRIVATE_TF = re.compile(r"tensorflow\.python|keras\.src|protected-access")
# The public API of namedtuples, spelled with an underscore.
_NAMEDTUPLE_API = frozenset(["_replace", "_asdict", "_fields", "_make"])
# Public names of the standard library that start with an underscore.
_STDLIB_API = frozenset(["_exit"])  # os._exit


def _private_names_defined(trees):
  """Every single-underscore name the package defines itself (functions,
  classes, attributes it assigns)."""
  names = set()
  for tree in trees:
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        names.add(node.name)
      elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
        names.add(node.attr)
      elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        names.add(node.id)
  return {name for name in names if name.startswith("_")}


def _private_reads(tree):
  """(line, name) of each `x._name` (x not self or cls) and each
  getattr/hasattr/setattr of a "_name" in `tree`, dunders left out."""
  found = []
  for node in ast.walk(tree):
    name = None
    if isinstance(node, ast.Attribute) and not (
        isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
      name = node.attr
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and
          node.func.id in ("getattr", "hasattr", "setattr") and
          len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and
          isinstance(node.args[1].value, str)):
      name = node.args[1].value
    if name and name.startswith("_") and not name.startswith("__"):
      found.append((node.lineno, name))
  return found


def test_tensorflow_private_parts_are_reached_from_tf_py_only():
  sources = {name: path.read_text() for name, path in _modules().items()}
  reaching = sorted(name for name, text in sources.items()
                    if _PRIVATE_TF.search(text))
  assert reaching == ["replicate._tf"]
  trees = {name: ast.parse(text) for name, text in sources.items()}
  own = (_private_names_defined(trees.values()) | _NAMEDTUPLE_API |
         _STDLIB_API)
  foreign = {name: [(line, attr) for line, attr in _private_reads(tree)
                    if attr not in own]
             for name, tree in trees.items() if name != "replicate._tf"}
  assert {name: reads for name, reads in foreign.items() if reads} == {}


def test_the_private_read_finder_finds_them():
  tree = ast.parse("op._update_input(0, x)\nself._mine = 1\n"
                   "getattr(head, '_weight_column', None)\nx.__class__\n")
  assert sorted(_private_reads(tree)) == [(1, "_update_input"),
                                  (3, "_weight_column")]
  assert _private_names_defined([tree]) == {"_mine"}


# docs/DESIGN.md's statements about the package, each held here.
DESIGN = PACKAGE.parent / "docs" / "DESIGN.md"


def _docstring_names(path):
  """The `name`s in backquotes of `path`'s module docstring."""
  return set(re.findall(r"`(\w+)`", ast.get_docstring(
      ast.parse(path.read_text())) or ""))


def test_every_sub_package_lists_each_of_its_modules():
  missing = {}
  for init in sorted(PACKAGE.glob("*/__init__.py")):
    listed = _docstring_names(init)
    modules = {path.stem for path in init.parent.glob("*.py")} - {"__init__"}
    if modules - listed:
      missing[init.parent.name] = sorted(modules - listed)
  assert missing == {}


def test_design_md_lists_every_module():
  text = DESIGN.read_text()
  tree = text[text.index("```text\nreplicate/"):]
  tree = tree[:tree.index("```", 3)]
  missing = []
  for name, path in _modules().items():
    parts = name.split(".")[1:]
    if len(parts) == 1:
      listed = parts[0] + (
          "/" if path.name == "__init__.py" else ".py") in tree
    elif len(parts) == 2:
      entry = re.search(r"^  {}/\s+(.*?)(?=^  \S|\Z)".format(parts[0]),
                        tree, re.MULTILINE | re.DOTALL)
      listed = bool(entry) and parts[1] in re.findall(r"\w+",
                                                      entry.group(1))
    else:
      listed = True  # the package itself
    if not listed:
      missing.append(name)
  assert missing == []


# What writing to a mutable global looks like: rebinding it (`global`), or
# changing it in place (an item, an attribute, a mutating method).
_MUTATORS = frozenset(["append", "add", "update", "setdefault", "pop",
                       "clear", "extend", "insert", "remove", "discard"])
# The package's mutable module globals; docs/DESIGN.md names each, with why.
MUTABLE_GLOBALS = frozenset([
    "replicate.communication.allreduce._replaced_gather_reduce",
    "replicate.cluster.server._servers",
    "replicate.cluster.sync_cluster._next_instance_key",
    "replicate.batch_norm.user_moments._STATE",
    "replicate.graph.declared._DECLARED_TYPES",
])


def mutable_globals(name, tree):
  """`name`.global of every module-level name that `tree` rebinds from a
  function (`global`) or changes in place anywhere."""
  module_level = set()
  for node in tree.body:
    targets = (node.targets if isinstance(node, ast.Assign) else
               [node.target] if isinstance(node, ast.AnnAssign) else [])
    module_level.update(target.id for target in targets
                        if isinstance(target, ast.Name))
  written = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Global):
      written.update(node.names)
    elif (isinstance(node, (ast.Subscript, ast.Attribute)) and
          isinstance(node.ctx, (ast.Store, ast.Del)) and
          isinstance(node.value, ast.Name)):
      written.add(node.value.id)
    elif (isinstance(node, ast.Call) and
          isinstance(node.func, ast.Attribute) and
          node.func.attr in _MUTATORS and
          isinstance(node.func.value, ast.Name)):
      written.add(node.func.value.id)
  return {name + "." + written_name
          for written_name in written & module_level}


def test_the_mutable_module_globals_are_the_named_ones():
  found = set()
  for name, path in _modules().items():
    found |= mutable_globals(name, ast.parse(path.read_text()))
  assert sorted(found) == sorted(MUTABLE_GLOBALS)
  text = " ".join(DESIGN.read_text().split())
  assert "No mutable module globals, but five " in text
  for name in MUTABLE_GLOBALS:
    module, variable = name[len("replicate."):].rsplit(".", 1)
    assert "`{}.py`'s `{}`".format(module.replace(".", "/"),
                                   variable) in text, name


def test_the_mutable_global_finder_finds_them():
  tree = ast.parse("A = {}\nB = []\nC = 1\nD = object()\nE = 2\n"
                   "def f():\n  A[1] = 2\n  B.append(3)\n  D.x = 1\n"
                   "  global E\n  E = 3\n")
  assert mutable_globals("m", tree) == {"m.A", "m.B", "m.D", "m.E"}


# The lower floors' functions that sum over a synchronous cluster's tasks
# are handed its collectives (`cross_task`, None in one task) by a caller
# that read them from the layout, and test that argument; the mode itself
# is asked of the strategy (`spans_tasks`, ...), never by comparing a
# strategy's or layout's `cross_task` with None.
TAKE_CROSS_TASK = frozenset([
    "replicate.batch_norm.batch_norm_sites", "replicate.variables.tower_local",
    "replicate.variables.tower_variables",
])


def _none_tests(tree):
  """The compared names/attributes of each `x is None`, `x is not None`."""
  found = []
  for node in ast.walk(tree):
    if (isinstance(node, ast.Compare) and len(node.ops) == 1 and
        isinstance(node.ops[0], (ast.Is, ast.IsNot)) and
        isinstance(node.comparators[0], ast.Constant) and
        node.comparators[0].value is None):
      found.append(node.left)
  return found


def test_a_mode_is_asked_of_the_strategy_not_of_cross_task():
  attributes, arguments = [], set()
  for name, path in _modules().items():
    for left in _none_tests(ast.parse(path.read_text())):
      if isinstance(left, ast.Attribute) and left.attr == "cross_task":
        attributes.append((name, left.lineno))
      elif ((isinstance(left, ast.Name) and left.id == "cross_task") or
            (isinstance(left, ast.Attribute) and left.attr == "_cross_task")):
        arguments.add(name)
  assert attributes == []
  assert arguments <= TAKE_CROSS_TASK
  text = " ".join(DESIGN.read_text().split())
  for name in TAKE_CROSS_TASK:
    assert "`{}.py`".format(
        name[len("replicate."):].replace(".", "/")) in text, name


def test_copies_variables_is_read_by_the_layout_alone():
  readers = sorted(
      name for name, path in _modules().items()
      for node in ast.walk(ast.parse(path.read_text()))
      if isinstance(node, ast.Attribute) and node.attr == "copies_variables"
      and isinstance(node.ctx, ast.Load))
  assert readers == ["replicate.call.layout"]
