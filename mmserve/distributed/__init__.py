"""Tensor parallelism on torch.distributed: the process's rank in its tensor-parallel group, the
collectives the layers call (gloo on CPU, NCCL on CUDA), how tensors are partitioned across ranks,
and the channel that broadcasts each step's scheduler output to the worker processes."""
