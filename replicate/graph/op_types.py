"""Op types by family, each written once.

On why here: the modules that ask what an op is (the batch reductions, the
metrics, placement, the rows rule, the state rule, the check) read these
sets instead of keeping their own copies, which drifted (a copy missing
`PyFuncStateless`, another `EuclideanNorm`). What a family means to one
rule (which reductions it can combine, which ops it lets pass) stays with
that rule, stated against these.
"""

# Ops that own a variable's storage (resource handles and TF 1 refs).
VARIABLE_TYPES = frozenset(["VarHandleOp", "VariableV2", "Variable"])
# Writes of a whole variable (a metric's `total.assign_add(...)`).
VARIABLE_WRITE_TYPES = frozenset([
    "AssignAddVariableOp", "AssignVariableOp", "AssignSubVariableOp",
    "AssignAdd", "Assign", "AssignSub"])
# Reductions along axes given as their second input.
REDUCTION_TYPES = frozenset(["Sum", "Mean", "Max", "Min", "Prod", "Any",
                             "All", "EuclideanNorm"])
# Ops whose values are sizes of a tensor, not its values.
SHAPE_TYPES = frozenset(["Shape", "ShapeN", "Size", "Rank"])
# Python functions: their output is anything made of their inputs.
PY_FUNC_TYPES = frozenset(["PyFunc", "PyFuncStateless", "EagerPyFunc"])
# Candidate samplers (sampled softmax, NCE): random draws of classes.
SAMPLER_TYPES = frozenset([
    "LogUniformCandidateSampler", "UniformCandidateSampler",
    "FixedUnigramCandidateSampler", "LearnedUnigramCandidateSampler",
    "AllCandidateSampler", "ThreadUnsafeUnigramCandidateSampler"])
# Random draws of the shape their first input gives (dropout's mask).
RANDOM_OF_SHAPE_TYPES = frozenset([
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal",
    "TruncatedNormal", "StatelessRandomUniform", "StatelessRandomUniformInt",
    "StatelessRandomNormal", "StatelessTruncatedNormal",
    "StatelessRandomUniformV2", "StatelessRandomUniformIntV2",
    "StatelessRandomNormalV2", "StatelessTruncatedNormalV2",
    "StatelessRandomUniformFullInt", "StatelessRandomUniformFullIntV2"])
# A TF 1 `while_loop`'s frame.
TF1_LOOP_TYPES = frozenset(["Enter", "RefEnter", "Exit", "RefExit",
                            "NextIteration", "RefNextIteration", "LoopCond"])
# Ops that run functions: TF 2 `cond` and `while_loop`, `tf.function` calls.
FUNCTION_CALL_TYPES = frozenset([
    "If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase",
    "PartitionedCall", "StatefulPartitionedCall"])
