"""Op types by what running them does to state, for `replicate.state.rule`.

TensorFlow marks ops stateful; these tables say which stateful ops write
a variable (and how), add to it, replace its elements, change a table, or
change nothing that outlives a step.
"""

# Variable writes: op type -> "add", "sub" or "set" (the value is input 1).
WRITE_KINDS = {
    "Assign": "set", "AssignVariableOp": "set",
    "AssignAdd": "add", "AssignAddVariableOp": "add",
    "AssignSub": "sub", "AssignSubVariableOp": "sub",
}
# Writes that add to what is there, so that every tower's adds up.
ADDITIVE_TYPES = frozenset([
    "ScatterAdd", "ScatterSub", "ResourceScatterAdd", "ResourceScatterSub",
    "ScatterNdAdd", "ScatterNdSub", "ResourceScatterNdAdd",
    "ResourceScatterNdSub",
])
# Writes that replace what is there, element by element.
REPLACING_TYPES = frozenset([
    "ScatterUpdate", "ResourceScatterUpdate", "ScatterNdUpdate",
    "ResourceScatterNdUpdate", "ScatterMul", "ScatterDiv", "ScatterMin",
    "ScatterMax", "ResourceScatterMul", "ResourceScatterDiv",
    "ResourceScatterMin", "ResourceScatterMax",
])
# Table changes whose union over towers is the batch's.
TABLE_UNION_TYPES = frozenset(["LookupTableInsertV2", "LookupTableInsert",
                                "LookupTableRemoveV2"])
# Table changes a tower on a stand-in row (a copy of the batch's first row)
# may repeat: inserting tower 0's first key and value again changes nothing.
IDEMPOTENT_TYPES = frozenset(["LookupTableInsertV2", "LookupTableInsert"])
# Stateful ops whose running changes nothing that outlives the step.
ALLOWED_TYPES = frozenset([
    "VarHandleOp", "VariableV2", "Variable", "ReadVariableOp", "VariableShape",
    "ResourceGather", "ResourceGatherNd", "VarIsInitializedOp",
    "IsVariableInitialized", "Assert", "Print", "PrintV2", "Timestamp",
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal",
    "TruncatedNormal", "RandomShuffle", "Multinomial", "RandomGamma",
    "RandomPoisson", "RandomPoissonV2", "ParameterizedTruncatedNormal",
    # Candidate samplers (sampled softmax, NCE): random draws, like dropout.
    "LogUniformCandidateSampler", "UniformCandidateSampler",
    "LearnedUnigramCandidateSampler", "FixedUnigramCandidateSampler",
    "ThreadUnsafeUnigramCandidateSampler", "AllCandidateSampler",
    "HashTableV2", "HashTable", "MutableHashTableV2",
    "MutableHashTableOfTensorsV2", "MutableDenseHashTableV2",
    "LookupTableFindV2", "LookupTableFind", "LookupTableSizeV2",
    "LookupTableExportV2", "TensorArrayV3", "TensorArrayReadV3",
    "TensorArrayWriteV3", "TensorArrayGatherV3", "TensorArrayScatterV3",
    "TensorArraySizeV3", "TensorArrayGradV3", "TensorArrayConcatV3",
    "TensorArraySplitV3", "TensorArrayCloseV3", "TensorArrayGradWithShape",
    "StackV2", "StackPushV2", "StackPopV2", "StackCloseV2",
    "IteratorGetNext", "IteratorGetNextSync", "IteratorV2",
    "AnonymousIteratorV2", "AnonymousIteratorV3", "DummySeedGenerator",
    "AnonymousSeedGenerator", "Placeholder", "PlaceholderWithDefault",
    "_Arg", "_Retval", "NoOp",
])
# Ops a variable's handle or ref passes through on its way to a write.
PASSING_TYPES = frozenset(["Enter", "RefEnter", "Identity", "RefIdentity",
                            "Switch", "RefSwitch"])
