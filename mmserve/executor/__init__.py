"""Executors: how the EngineCore reaches its workers. One interface (`Executor`), three ways:
the one worker in the EngineCore's process (uni), one worker process per tensor-parallel rank on
this machine (mp), or Ray actors placed on the nodes of a Ray cluster (ray). Every worker holds
its requests' state; each step the scheduler's diff is sent to all of them once."""
