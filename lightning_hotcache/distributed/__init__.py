"""Several processes: collectives on the device a group needs, global batches split across
ranks, even batch counts, and replicated tables' sparse gradients under plain DDP."""
