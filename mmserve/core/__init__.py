"""EngineCore: the scheduler and its bookkeeping (KV blocks, prefix cache, encoder cache).

Nothing here touches a device or a model: `core` decides, the worker computes.
"""
