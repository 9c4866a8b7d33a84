"""The Ray backend on a Ray cluster this test starts itself: a head node and a second node on
this machine, one CPU each, so the placement group's two bundles (one per rank) land on
different nodes. TP=2 across the two nodes gives TP=1's tokens."""

from __future__ import annotations

import os

import pytest
from tp_cases import ENGINE, GREEDY, chats, single_rank_tokens

from mmserve.entrypoints.llm import LLM
from mmserve.openmp_env import SPIN_COUNT
from mmserve.testing.checkpoints import checkpoint

pytestmark = [pytest.mark.timeout(300), pytest.mark.heavy]

NODE = {"num_cpus": 1, "object_store_memory": 80 * 1024 * 1024}


@pytest.fixture
def ray_cluster(monkeypatch):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    try:
        cluster.add_node(**NODE)
        cluster.wait_for_nodes()
        monkeypatch.setenv("RAY_ADDRESS", cluster.address)  # where the executor's ray.init() connects
        yield cluster
    finally:
        cluster.shutdown()


def test_tp2_across_two_ray_nodes_matches_tp1(ray_cluster):
    model_dir = checkpoint("qwen2_vl")
    convs = chats()
    with LLM(model_dir, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE) as llm:
        node_ids = llm.engine_core.executor.node_ids
        outputs = llm.chat([c[0] for c in convs], GREEDY)
    assert len(set(node_ids)) == 2, "one rank per node"
    assert [out.outputs[0].token_ids for out in outputs] == single_rank_tokens(model_dir)[0]


def test_ray_workers_start_with_the_openmp_spin_count(ray_cluster, monkeypatch):
    """mmserve.openmp_env reaches the actors' processes, as it reaches multiprocessing's."""
    import ray

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with LLM(
        checkpoint("qwen2_vl"), tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE
    ) as llm:
        actors = llm.engine_core.executor.actors
        spin_counts = ray.get(
            [a.__ray_call__.remote(lambda _: os.environ.get("GOMP_SPINCOUNT")) for a in actors]
        )
    assert spin_counts == [str(SPIN_COUNT)] * 2
