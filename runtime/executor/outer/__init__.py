"""Cross-island outer syncs of ``local_sgd`` and ``async`` groups: the per-rank schedule and
checkpoints (``outer_sync``), one fragment's rule (``outer_fragment``), the quantized
exchange among island leads (``outer_exchange``) and its codec (``pseudo_gradient_codec``)."""
