"""The draft tree: its nodes, which of them are verified, and who attends to whom.

Nodes are kept in one list, parents before children; a node names its parent by index (-1:
the root, the latest committed token x_L). A chain is the tree where each node's parent is the
one before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Shape suffixes: W draft vocab, H draft hidden.


@dataclass
class Node:
    """A drafted token: a child of the root (x_L) or of another node."""

    token: int  # target id
    parent: int  # index in the node list, -1 for the root
    depth: int  # 1 for children of the root
    score: float  # cumulative draft log-probability
    draft_probs_W: torch.Tensor | None = None  # the distribution it was sampled from (chain)
    draft_id: int = -1
    hidden_H: torch.Tensor | None = None  # output of feeding this node (predicts its children)


def select_nodes(nodes: list[Node], total_draft_tokens: int) -> list[Node]:
    """The best ``total_draft_tokens`` nodes, closed under ancestors, parents first."""
    order = sorted(range(len(nodes)), key=lambda j: (-nodes[j].score, nodes[j].depth))
    chosen: list[int] = []
    for j in order:
        if len(chosen) == total_draft_tokens:
            break
        if nodes[j].parent < 0 or nodes[j].parent in chosen:
            chosen.append(j)
    chosen.sort(key=lambda j: (nodes[j].depth, j))
    renumber = {old: new for new, old in enumerate(chosen)}
    return [
        Node(
            token=nodes[j].token,
            parent=renumber.get(nodes[j].parent, -1),
            depth=nodes[j].depth,
            score=nodes[j].score,
        )
        for j in chosen
    ]


def drafting_mask(nodes: list[Node], frontier: list[int], fed: list[int]) -> torch.Tensor:
    """[F, len(fed) + F] bool over the keys of the ``fed`` nodes, then of the F ``frontier``
    nodes being fed: each frontier node sees its fed ancestors and itself."""
    mask = torch.zeros(len(frontier), len(fed) + len(frontier), dtype=torch.bool)
    for row, i in enumerate(frontier):
        mask[row, len(fed) + row] = True
        ancestor = nodes[i].parent
        while ancestor >= 0:
            mask[row, fed.index(ancestor)] = True
            ancestor = nodes[ancestor].parent
    return mask


def verification_mask(nodes: list[Node]) -> torch.Tensor:
    """[1+N, 1+N] bool: the root and each node see the root, their ancestors and themselves."""
    size = len(nodes) + 1
    mask = torch.zeros(size, size, dtype=torch.bool)
    mask[:, 0] = True
    for i, node in enumerate(nodes):
        mask[i + 1, i + 1] = True
        parent = node.parent
        while parent >= 0:
            mask[i + 1, parent + 1] = True
            parent = nodes[parent].parent
    return mask
