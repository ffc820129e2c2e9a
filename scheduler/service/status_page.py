"""The swarm's status page (HTML), rendered from a status dict (pure: no I/O).

The same dict is served as JSON at `/api/status`, by the scheduler (`SchedulerCore.status`) and by
`swarm-health` (from the DHT alone). The block-coverage map draws one row per server with its span
over blocks 0..L-1; every span is an SVG rect with `data-peer`, `data-start` and `data-end`, so a
browser test can check the map against the swarm.
"""

from __future__ import annotations

from jinja2 import Environment, PackageLoader, select_autoescape

from llm_swarm.scheduler.service.request_stats import SUMMARY_KEYS

STATE_COLORS = {"online": "#2e9d5b", "moving": "#e39b21", "joining": "#8d99ae", "offline": "#c8553d"}


_environment = Environment(
    loader=PackageLoader("llm_swarm.scheduler", "templates"), autoescape=select_autoescape()
)
_template = _environment.get_template("status.html")

LABEL_WIDTH = 170
PLOT_WIDTH = 840
ROW_HEIGHT = 24


def _coverage_color(count: int) -> str:
    if count == 0:
        return "#c8553d"
    shades = ["#cfe8d8", "#9fd1b2", "#6fbb8c", "#3fa466", "#2e7d4d"]
    return shades[min(count, len(shades)) - 1]


SERVERS_PER_PAGE = 50  # hundreds of servers: the summary, the coverage row, and the servers a page at a time


def coverage_map(status: dict, servers: list[dict] | None = None) -> dict:
    """Geometry of the coverage map: one row per server of `servers` (default: all; a page of them on
    a large swarm), then the per-block coverage row of the whole swarm."""
    servers = status["servers"] if servers is None else servers
    num_blocks = max(status["num_blocks"], 1)
    cell = PLOT_WIDTH / num_blocks
    left = LABEL_WIDTH

    def box(start: int, end: int) -> dict:
        return {"x": round(left + start * cell, 2), "width": round((end - start) * cell, 2)}

    rows = []
    for index, server in enumerate(servers):
        y = 20 + index * ROW_HEIGHT
        name = server["public_name"] or server["peer_id"][-8:]
        has_span = server["start"] >= 0
        assigned = server["assigned_start"] >= 0
        differs = assigned and (server["assigned_start"], server["assigned_end"]) != (
            server["start"],
            server["end"],
        )
        rows.append(
            {
                "y": y,
                "label": name[:24],
                "peer": server["peer_id"],
                "state": server["state"],
                "color": STATE_COLORS.get(server["state"], "#8d99ae"),
                "start": server["start"],
                "end": server["end"],
                "span": box(server["start"], server["end"]) if has_span else None,
                "assigned": box(server["assigned_start"], server["assigned_end"]) if differs else None,
                "assigned_label": f"{server['assigned_start']}:{server['assigned_end']}",
            }
        )
    coverage_y = 20 + len(rows) * ROW_HEIGHT + 6
    step = max(1, round(num_blocks / 16))
    ticks = [{"x": round(left + (b + 0.5) * cell, 2), "label": b} for b in range(0, num_blocks, step)]
    coverage = [
        {
            "block": b,
            "count": count,
            "x": round(left + b * cell, 2),
            "width": round(cell, 2),
            "color": _coverage_color(count),
        }
        for b, count in enumerate(status["coverage"])
    ]
    return {
        "width": left + PLOT_WIDTH + 10,
        "height": coverage_y + 26,
        "left": left,
        "plot_width": PLOT_WIDTH,
        "cell": cell,
        "rows": rows,
        "ticks": ticks,
        "coverage": coverage,
        "coverage_y": coverage_y,
    }


def render_status_page(
    status: dict,
    title: str,
    subtitle: str = "",
    refresh: int = 5,
    page: int = 0,
    per_page: int = SERVERS_PER_PAGE,
) -> str:
    """The page; with more than `per_page` servers the map rows and the table show page `page` (0-based,
    clamped) and links to the others, while the summary and the coverage row cover everyone."""
    bound = status.get("bound", -1.0)
    rate = status.get("arrival_rate", 0.0)
    requests = {key: status.get(key, 0) for key in SUMMARY_KEYS}
    servers = status["servers"]
    pages = max(1, -(-len(servers) // per_page))
    page = min(max(page, 0), pages - 1)
    shown = servers[page * per_page : (page + 1) * per_page]
    return _template.render(
        title=title,
        subtitle=subtitle,
        refresh=refresh,
        servers=servers,
        shown=shown,
        page=page,
        pages=pages,
        first_shown=page * per_page,
        online=sum(1 for s in servers if s["state"] == "online"),
        relayed=sum(1 for s in servers if s.get("reachability") == "relay"),
        unreachable=sum(1 for s in servers if s.get("reachability") == "unreachable"),
        num_blocks=status["num_blocks"],
        uncovered=status["uncovered_blocks"],
        policy=status.get("policy", "-"),
        num_requests=status.get("num_requests"),
        bound=f"{bound * 1000:.1f} ms" if bound and bound > 0 else "-",
        arrival_rate=f"{rate:.2f}/s" if rate else "-",
        active_sessions=status.get("active_sessions", 0),
        waiting_sessions=status.get("waiting_sessions", 0),
        map=coverage_map(status, shown),
        colors=STATE_COLORS,
        requests=requests,
    )
