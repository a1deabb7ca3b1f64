"""The docs sections the port's report sends a reader to (each entry's
``read:`` line); tests/test_port_docs.py checks each heading exists."""

SECTION_PORTING = 'README "Porting a TF1 script"'
SECTION_UPDATE_OPS = 'README "Porting a TF1 script", point "UPDATE_OPS"'
SECTION_GLOBAL_STEP = 'README "Porting a TF1 script", point "global_step"'
SECTION_NPU_INIT = 'README "Porting a TF1 script", point "from npu_bridge.npu_init import *"'
SECTION_MANAGERS = 'README "Managers"'
SECTION_PER_GROUP_SCALES = 'README "Per-group loss scales"'
SECTION_LSO = 'README "LossScaleOptimizer"'
SECTION_GRAPH_REWRITE = 'README "Graph-rewrite mixed precision"'
SECTION_DATA_PARALLEL = 'README "Data parallelism"'
SECTION_SYNC_REPLICAS = 'docs/distributed.md "Parameter servers"'
SECTION_BUILDER = 'README "MultiOptimizerLossScale" (add(..., transform_grads_fn=...))'
SECTION_PORT = 'docs/port.md "What it leaves to you"'
SECTION_SEQUENCE = 'docs/features.md "Sub-steps in one op (`sequence`)"'
