"""Op types known to keep the batch's rows apart, by family.

On why: `replicate.shard.rows_meet` fails closed. An op on the path from a
tower's rows to the loss passes only when its type is known here (each
output row is computed from the same input row alone, or the op carries
no rows' values at all), or when its type has a rule of
its own (`replicate.graph.row_rules`: matmuls, top_k, cumulative sums,
segment ops, linear algebra, ...: refused in the patterns that combine
rows, passed otherwise). Any other type is refused, naming it, with the fix
through `replicate.all_rows`.

On how the list was chosen: every op type that the check met on that path
in every model of the oracle zoo (tests/oracle/oracle_zoo.py, the canned
estimators included) and of the test suite's real programs (BERT-style,
DeepFM, the Transformer, Keras model_fns, TF 1 and TF 2 control flow,
feature columns with sparse and embedding columns, TPUEstimatorSpec,
`all_rows`), wrapped on 2 towers in TRAIN, EVAL and PREDICT, in TF 2 and
TF 1 behaviour (tests/test_zoo_ops.py keeps the zoo's part); then
TensorFlow's families (`tf.raw_ops`) that are per row by construction, so
that ordinary models pass. Ops that can combine rows in some use are left
out, refused on the path: `RandomShuffle`, `UniqueWithCounts`, `Bincount`,
Python functions (`PyFunc`, `EagerPyFunc`), custom ops. Gathers, scatters
and segment ops have rules (`replicate.graph.index_rules`): they keep rows
apart exactly when they map each row to itself. A gather of a variable
(`ResourceGather`: an embedding lookup) holds no rows.
"""

from typing import Dict, FrozenSet, List, Optional, Tuple

from replicate.graph import op_types


def _ops(text: str) -> FrozenSet[str]:
  return frozenset(text.split())


# family: (why it keeps rows apart, op types)
FAMILIES: Dict[str, Tuple[str, FrozenSet[str]]] = {
    "elementwise": ("each output element from the same position of the "
                    "inputs (broadcasting a value without rows)", _ops("""
        Abs Acos Acosh Add AddV2 AddN AccumulateNV2 Angle ApproximateEqual
        Asin Asinh Atan Atan2 Atanh BesselI0 BesselI0e BesselI1 BesselI1e
        BesselJ0 BesselJ1 BesselK0 BesselK0e BesselK1 BesselK1e BesselY0
        BesselY1 Betainc Bitcast BitwiseAnd BitwiseOr BitwiseXor Cast Ceil
        ClipByValue Complex ComplexAbs Conj Cos Cosh Dawsn Digamma Div
        DivNoNan Equal Erf Erfc Erfinv Exp Expint Expm1 Floor FloorDiv
        FloorMod FresnelCos FresnelSin Greater GreaterEqual Igamma Igammac
        Imag Inv Invert IsFinite IsInf IsNan LeftShift Less LessEqual Lgamma
        Log Log1p LogicalAnd LogicalNot LogicalOr Maximum Minimum Mod Mul
        MulNoNan Ndtri Neg NextAfter NotEqual OneHot Polygamma
        PopulationCount Pow Real RealDiv Reciprocal RightShift Rint Round
        Rsqrt Select SelectV2 Sign Sin Sinh Spence Sqrt Square
        SquaredDifference Sub Tan TruncateDiv TruncateMod Xdivy Xlog1py Xlogy
        Zeta QuantizeAndDequantizeV2 QuantizeAndDequantizeV3
        QuantizeAndDequantizeV4 FakeQuantWithMinMaxArgs
        FakeQuantWithMinMaxVars FakeQuantWithMinMaxVarsPerChannel""")),
    "activations": ("elementwise", _ops("""
        Relu Relu6 Elu Selu LeakyRelu Sigmoid Tanh Softplus Softsign ReluGrad
        Relu6Grad EluGrad SeluGrad LeakyReluGrad SigmoidGrad TanhGrad
        SoftplusGrad SoftsignGrad RsqrtGrad SqrtGrad ReciprocalGrad InvGrad""")),
    "losses per row": ("one loss or decision per row from that row's logits, "
                       "label (and a sampler's classes)", _ops("""
        SparseSoftmaxCrossEntropyWithLogits
        InTopK InTopKV2 CTCLoss CTCLossV2 CTCGreedyDecoder
        CTCBeamSearchDecoder EditDistance ComputeAccidentalHits""")),
    "layers per example": ("convolutions, pooling, resizing, recurrent "
                           "cells: within each example", _ops("""
        BiasAdd BiasAddV1 Conv Conv2D Conv3D DepthwiseConv2dNative
        Conv2DBackpropInput Conv2DBackpropInputV2 Conv3DBackpropInputV2
        DepthwiseConv2dNativeBackpropInput Dilation2D MaxPool MaxPoolV2
        MaxPool3D AvgPool AvgPool3D MaxPoolWithArgmax MaxPoolGrad
        MaxPoolGradV2 AvgPoolGrad LRN ExtractImagePatches
        ExtractVolumePatches SpaceToDepth DepthToSpace SpaceToBatchND
        BatchToSpaceND ResizeBilinear ResizeNearestNeighbor ResizeBicubic
        ResizeArea ScaleAndTranslate AdjustContrastv2 AdjustHue
        AdjustSaturation RGBToHSV HSVToRGB LSTMBlockCell GRUBlockCell
        BlockLSTM BlockLSTMV2 CudnnRNN CudnnRNNV2 CudnnRNNV3""")),
    "batch norm": ("its moments over the batch are the batch norm rule's "
                   "(sync_batch_norm); with moving statistics, per row",
                   _ops("""
        FusedBatchNorm FusedBatchNormV2 FusedBatchNormV3
        BatchNormWithGlobalNormalization""")),
    "reductions": ("over a row's own axes, or over the batch: the loss "
                   "rule's, `shard.batch_reductions`' and the metrics'",
                   _ops("""
        Sum Mean Max Min Prod Any All ArgMax ArgMin EuclideanNorm
        L2Loss""")),
    "layout": ("moves, selects, joins or repeats whole rows or values "
               "within rows", _ops("""
        Identity IdentityN Snapshot Reshape ExpandDims Squeeze Transpose
        ConjugateTranspose Pack Unpack Concat ConcatV2 Split SplitV
        Tile Pad PadV2 MirrorPad BroadcastTo ReverseSequence
        ResourceGather ResourceGatherNd DynamicPartition DynamicStitch ParallelDynamicStitch Unique
        UniqueV2 Where EnsureShape StopGradient PreventGradient
        CheckNumerics CheckNumericsV2 DebugGradientIdentity GuaranteeConst
        StridedSliceGrad""")),
    "shapes and constants": ("not the rows' values: their shape, or no "
                             "data", _ops("""
        Const Shape ShapeN Size Rank BroadcastArgs BroadcastGradientArgs Fill
        ZerosLike OnesLike Range LinSpace ConcatOffset InvertPermutation
        DataFormatDimMap DataFormatVecPermute Placeholder PlaceholderV2
        PlaceholderWithDefault NoOp ControlTrigger Assert Print PrintV2""")),
    "control flow": ("passes values on, or calls a function on them (TF 1 "
                     "loops and conds, TF 2 function calls)", _ops("""
        Switch RefSwitch Merge RefMerge Enter RefEnter Exit RefExit
        NextIteration RefNextIteration LoopCond If StatelessIf Case
        StatelessCase PartitionedCall
        StatefulPartitionedCall""")),
    "loop containers": ("a loop's per-step values (dynamic_rnn, beam "
                        "search): stored and read back, rows kept",
                        _ops("""
        TensorArrayV3 TensorArrayReadV3 TensorArrayWriteV3
        TensorArrayScatterV3 TensorArrayGatherV3 TensorArraySizeV3
        TensorArrayConcatV3 TensorArraySplitV3 TensorArrayCloseV3
        TensorArrayGradV3 TensorArrayGradWithShape TensorListFromTensor
        TensorListGetItem TensorListSetItem TensorListStack TensorListReserve
        TensorListElementShape TensorListLength TensorListPushBack
        TensorListPopBack TensorListGather TensorListScatter
        TensorListScatterV2 TensorListScatterIntoExistingList
        TensorListConcat TensorListConcatV2 TensorListSplit
        TensorListResize EmptyTensorList""")),
    "state": ("reads and writes of variables (a metric's totals, per "
              "class too): the state rule's and the metrics', not rows",
              _ops("""
        VarHandleOp ReadVariableOp VariableV2 Variable VarIsInitializedOp
        IsVariableInitialized VariableShape Assign AssignAdd AssignSub
        AssignVariableOp AssignAddVariableOp AssignSubVariableOp
        ScatterAdd ScatterSub ScatterUpdate ScatterMax ScatterMin ScatterMul
        ScatterDiv ScatterNdAdd ScatterNdSub ScatterNdUpdate ScatterNdMax
        ScatterNdMin ResourceScatterAdd ResourceScatterSub
        ResourceScatterUpdate ResourceScatterMax ResourceScatterMin
        ResourceScatterMul ResourceScatterDiv ResourceScatterNdAdd
        ResourceScatterNdSub ResourceScatterNdUpdate ResourceScatterNdMax
        ResourceScatterNdMin DestroyResourceOp MutexV2 MutexLock
        ConsumeMutexLock""")),
    "random": ("draws, one per element; not the rows' values", _ops("""
        RandomUniform RandomUniformInt RandomStandardNormal TruncatedNormal
        ParameterizedTruncatedNormal RandomGamma RandomPoisson
        RandomPoissonV2 Multinomial StatelessRandomUniform
        StatelessRandomUniformV2 StatelessRandomUniformInt
        StatelessRandomUniformIntV2 StatelessRandomUniformFullInt
        StatelessRandomUniformFullIntV2 StatelessRandomNormal
        StatelessRandomNormalV2 StatelessTruncatedNormal
        StatelessTruncatedNormalV2 StatelessMultinomial
        StatelessRandomBinomial StatelessRandomGammaV2
        StatelessRandomGammaV3 StatelessRandomPoisson
        StatelessParameterizedTruncatedNormal StatelessRandomGetKeyCounter
        StatelessRandomGetKeyCounterAlg StatelessRandomGetAlg StatefulUniform
        StatefulUniformInt StatefulUniformFullInt StatefulStandardNormalV2
        StatefulTruncatedNormal StatefulRandomBinomial RngSkip RngReadAndSkip
        NonDeterministicInts AnonymousSeedGenerator
        AnonymousRandomSeedGenerator DummySeedGenerator""")),
    "strings, parsing and lookups": ("feature columns: each string, id or "
                                     "example on its own", _ops("""
        AsString StringJoin StringSplit StringSplitV2 Substr StringLower
        StringUpper StringStrip StringLength StringNGrams StringToNumber
        StringToHashBucket StringToHashBucketFast StringToHashBucketStrong
        RegexReplace RegexFullMatch StaticRegexReplace StaticRegexFullMatch
        UnicodeDecode UnicodeDecodeWithOffsets UnicodeEncode UnicodeScript
        UnicodeTranscode DecodeBase64 EncodeBase64 DecodeRaw DecodePaddedRaw
        DecodeCSV DecodeJSONExample ParseExample ParseExampleV2
        ParseSingleExample ParseSequenceExample ParseSequenceExampleV2
        ParseSingleSequenceExample ParseTensor SerializeTensor Fingerprint
        Bucketize HashTable HashTableV2 MutableHashTable MutableHashTableV2
        MutableHashTableOfTensors MutableHashTableOfTensorsV2
        MutableDenseHashTableV2 AnonymousHashTable AnonymousMutableHashTable
        LookupTableFind LookupTableFindV2 LookupTableSize LookupTableSizeV2
        InitializeTable InitializeTableV2 InitializeTableFromTextFile
        InitializeTableFromTextFileV2""")),
    "sparse and ragged": ("a sparse or ragged tensor's entries, each kept "
                          "at its row (embedding and crossed columns; "
                          "tf.sets along the last axis)",
                          _ops("""
        SparseReshape SparseFillEmptyRows SparseToDense SparseSlice
        SparseReorder SparseConcat SparseSplit SparseAdd SparseCross
        SparseCrossHashed SparseCrossV2 SparseTensorDenseAdd
        SparseDenseCwiseAdd SparseDenseCwiseMul SparseDenseCwiseDiv
        SparseSoftmax SerializeSparse SerializeManySparse DeserializeSparse
        DeserializeManySparse RaggedTensorToTensor RaggedTensorToSparse
        RaggedTensorFromVariant RaggedTensorToVariant RaggedGather
        RaggedRange RaggedCross RaggedFillEmptyRows DenseToDenseSetOperation
        DenseToSparseSetOperation SparseToSparseSetOperation SetSize""")),
    "input": ("the input pipeline: gives the batch, does not compute on it",
              _ops("""
        IteratorGetNext IteratorGetNextSync IteratorV2 Iterator
        OneShotIterator MakeIterator AnonymousIterator AnonymousIteratorV2
        AnonymousIteratorV3 OptionalGetValue OptionalHasValue
        OptionalFromValue OptionalNone""")),
    "summaries": ("write what they see; no value on the path", _ops("""
        ScalarSummary HistogramSummary ImageSummary AudioSummaryV2
        TensorSummary TensorSummaryV2 MergeSummary WriteScalarSummary
        WriteHistogramSummary WriteImageSummary WriteSummary
        WriteRawProtoSummary""")),
}

# Function calls: their bodies' op types are checked (`unknown_in_calls`).
CALLS = op_types.FUNCTION_CALL_TYPES

KEEPS_ROWS_APART: FrozenSet[str] = frozenset().union(
    *(types for _, types in FAMILIES.values()))


def keeps_rows_apart(op_type: str) -> bool:
  """Whether `op_type` is known to keep the batch's rows apart."""
  return op_type in KEEPS_ROWS_APART


def unknown_in_calls(op, library, also_known) -> Optional[Tuple[str, str]]:
  """(op type, node name) of the first node, in the functions `op` calls
  (a TF 2 `tf.cond` or `tf.while_loop`, a `tf.function`) and in those they
  call, whose type is neither known here nor in `also_known`; None if
  every one is. `library`: {function name: FunctionDef} of the graph.

  Only types are checked inside a function: the patterns of `also_known`'s
  rules need the outer graph's shapes and rows, so those types pass there.
  """
  pending, seen = list(_called(op.node_def)), set()
  while pending:
    name = pending.pop()
    if name in seen or name not in library:
      continue
    seen.add(name)
    for node in library[name].node_def:
      if not (keeps_rows_apart(node.op) or node.op in also_known or
              node.op in library):
        return node.op, "{}/{}".format(name, node.name)
      pending.extend(_called(node))
      if node.op in library:  # a call of a function by its own name
        pending.append(node.op)
  return None


def _called(node_def) -> List[str]:
  """Names of the functions a node calls (its function-valued attrs)."""
  names = []
  for value in node_def.attr.values():
    if value.HasField("func"):
      names.append(value.func.name)
    names.extend(func.name for func in value.list.func)
  return names
