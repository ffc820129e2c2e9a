"""Internet Topology Zoo graphs in the Repetita `.graph` format and their RTT matrices (Sun et al., Table 3).

The format: a `NODES n` section (`label x y` rows), then an `EDGES m` section with rows
`label src dest weight bw delay`, the delay in microseconds. Sun et al., section 4.1 computes the RTT
between two nodes from the cumulative delay along the delay-shortest path: RTT = 2 x that delay.
"""

from __future__ import annotations

from pathlib import Path

import networkx as nx
import numpy as np

MICROSECOND = 1e-6


def parse_repetita(text: str) -> nx.Graph:
    """An undirected graph with a `delay` (seconds) per edge; parallel edges keep the smallest delay."""
    graph = nx.Graph()
    section = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        head = line.split()
        if head[0] in ("NODES", "EDGES"):
            section = head[0]
            continue
        if head[0] == "label":  # column header
            continue
        if section == "NODES":
            graph.add_node(len(graph))
        elif section == "EDGES":
            if len(head) < 6:
                raise ValueError(f"malformed edge row: {line!r}")
            src, dst, delay = int(head[1]), int(head[2]), float(head[5]) * MICROSECOND
            if not graph.has_edge(src, dst) or graph[src][dst]["delay"] > delay:
                graph.add_edge(src, dst, delay=delay)
    if graph.number_of_nodes() == 0:
        raise ValueError("no NODES section found")
    return graph


def load_graph(path: Path) -> nx.Graph:
    return parse_repetita(path.read_text())


def rtt_matrix(graph: nx.Graph) -> np.ndarray:
    """`RTT[u, v] = 2 x` delay of the delay-shortest path (inf when disconnected)."""
    size = graph.number_of_nodes()
    rtt = np.full((size, size), np.inf)
    for source, lengths in nx.all_pairs_dijkstra_path_length(graph, weight="delay"):
        for target, delay in lengths.items():
            rtt[source, target] = 2 * delay
    return rtt
