"""How a rank keeps its optimizer when memory binds: :mod:`.offload` steps it in host memory,
:mod:`.zero` shards its state (and under stage 2 the summed gradients) among the holders;
and its parameters: :mod:`.tensor_parallel` splits a stage's across its TP group."""
