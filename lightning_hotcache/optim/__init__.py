"""Row-wise optimizers of embedding rows (state per row, applied to a batch's distinct rows)
and the stacked view of a collection's tables they step."""
