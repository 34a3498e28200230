"""The Lightning strategies: ``hotcache`` (`HotCacheStrategy`), ``torchrec``
(`TorchRecStrategy`), their shared one-process behaviour (`LikeAutoInOneProcess`) and the
fit-time checks they share (gradient accumulation, half-precision models)."""
