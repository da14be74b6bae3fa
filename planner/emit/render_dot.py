"""The DOT (graphviz) view of a plan, behind ``hplan show --format dot`` and ``plan.dot``.

A pure, deterministic ``Plan -> str`` built with pydot.
"""

from __future__ import annotations

import itertools

import pydot

from hplan.planner.textfmt import (
    batch_share,
    boundary_bytes,
    compact_units,
    format_seconds,
    percent,
)
from hplan.runtime.contract.holders import sync_summary
from hplan.runtime.contract.plan import Plan, RankPlan
from hplan.runtime.contract.quantities import format_bytes


def render_dot(plan: Plan) -> str:
    """The plan as graphviz DOT text, built with pydot.

    One cluster per node (inside a dashed cluster per island, when the plan has islands),
    one graph node per rank (device kind, replica and stage, units, batch share; the ranks
    of a TP group inside a bold cluster of their own), solid pipeline edges labelled with
    the bytes one micro-batch sends across that boundary, dashed undirected edges between
    ranks of consecutive replicas that hold the same units (their gradients are
    synchronised), and a graph label with the summary.
    """
    graph = pydot.Dot("plan", graph_type="digraph")
    graph.set_graph_defaults(rankdir="LR", labelloc="t", fontname="Helvetica")
    graph.set_node_defaults(shape="box", fontname="Helvetica")
    graph.set_edge_defaults(fontname="Helvetica", fontsize="10")
    graph.set("label", _dot_text(_dot_title(plan)))
    islands = _dot_islands(plan)
    for node_idx, node in enumerate(plan.cluster.nodes):
        label = _dot_text(f"{node.name} ({node.host})")
        cluster = pydot.Subgraph(f"cluster_node{node_idx}", label=label)
        for rank in plan.ranks:
            if rank.node != node.name or rank.tp_rank > 0:
                continue
            dot_rank = _dot_rank(rank, rank.rank == plan.report.bottleneck_rank)
            if rank.tp_degree == 1:
                cluster.add_node(dot_rank)
                continue
            group = plan.tp_group(rank.rank)
            tp_label = _dot_text(
                f"TP group of {rank.tp_degree}: ranks {group[0].rank}-{group[-1].rank}"
            )
            tp_cluster = pydot.Subgraph(f"cluster_tp{rank.rank}", label=tp_label, style="bold")
            tp_cluster.add_node(dot_rank)
            for member in group[1:]:
                tp_cluster.add_node(_dot_rank(member, False))
            cluster.add_subgraph(tp_cluster)
        (islands.get(node.name) or graph).add_subgraph(cluster)
    for island in dict.fromkeys(islands.values()):
        graph.add_subgraph(island)
    for edge in _pipeline_edges(plan) + _data_parallel_edges(plan):
        graph.add_edge(edge)
    return graph.to_string()


def _dot_islands(plan: Plan) -> dict[str, pydot.Subgraph]:
    """Node name -> the dashed cluster of its island (``training.sync``); empty without
    islands."""
    sync = plan.training.sync
    if sync is None:
        return {}
    out: dict[str, pydot.Subgraph] = {}
    for idx, island in enumerate(sync.islands):
        label = _dot_text(f"island {island.name}")
        cluster = pydot.Subgraph(f"cluster_island{idx}", label=label, style="dashed")
        out.update(dict.fromkeys(island.nodes, cluster))
    return out


def _dot_text(text: str) -> str:
    """A plan string made safe for a DOT label: backslashes doubled (pydot escapes quotes)."""
    return text.replace("\\", "\\\\")


def _dot_title(plan: Plan) -> str:
    report = plan.report
    return "\n".join(
        (
            f"{plan.model.path} on {plan.cluster.name}: global batch {plan.global_batch_size}",
            f"{format_seconds(report.predicted_step_time_s)} per step, "
            f"{report.predicted_samples_per_s:.1f} samples/s, "
            f"efficiency {percent(report.efficiency)}",
            _dot_data_parallel_note(plan),
        )
    )


def _dot_data_parallel_note(plan: Plan) -> str:
    if plan.num_replicas == 1:
        return "1 replica (no data parallelism)"
    return (
        f"{plan.num_replicas} replicas, data parallel by {sync_summary(plan)} "
        "(dashed: ranks that synchronise the units named)"
    )


def _dot_rank(rank: RankPlan, bottleneck: bool) -> pydot.Node:
    lines = (
        f"rank {rank.rank}: {rank.device_kind}"
        + (f" tp_rank {rank.tp_rank}/{rank.tp_degree}" if rank.tp_degree > 1 else "")
        + (" (bottleneck)" if bottleneck else ""),
        f"replica {rank.replica}, stage {rank.stage}",
        compact_units(rank.units),
        f"{batch_share(rank)} samples",
    )
    node = pydot.Node(f"rank{rank.rank}", label=_dot_text("\n".join(lines)))
    if bottleneck:
        node.set("penwidth", "2")
        node.set("color", "red")
    return node


def _pipeline_edges(plan: Plan) -> list[pydot.Edge]:
    edges = []
    for replica in range(plan.num_replicas):
        stages = plan.replica_ranks(replica)
        for sender, receiver in itertools.pairwise(stages):
            cut = plan.cut_after(sender.units[-1])
            size = format_bytes(boundary_bytes(cut, sender.micro_batch_size))
            label = f"{size} / micro-batch"
            edges.append(pydot.Edge(f"rank{sender.rank}", f"rank{receiver.rank}", label=label))
    return edges


def _data_parallel_edges(plan: Plan) -> list[pydot.Edge]:
    edges = []
    for replica in range(plan.num_replicas - 1):
        for left in plan.replica_ranks(replica):
            for right in plan.replica_ranks(replica + 1):
                shared = [u for u in left.units if u in set(right.units)]
                if not shared:
                    continue
                edges.append(
                    pydot.Edge(
                        f"rank{left.rank}",
                        f"rank{right.rank}",
                        label=_dot_text(compact_units(shared)),
                        style="dashed",
                        dir="none",
                        constraint="false",
                        color="gray40",
                    )
                )
    return edges
