"""Device kernels written for this library: a table-batched embedding in Triton (`triton_tbe`),
which needs only torch and Triton (every CUDA build of torch ships Triton), for the device
tier where FBGEMM's CUDA kernels are not installed."""
