"""Scenario files: sites, the processes each one runs, and the RTT / bandwidth of every pair of sites.

A scenario is JSON (or YAML when PyYAML is installed). Everything network-related is given per
*pair of sites*; a site is one network namespace, i.e. one emulated machine. Sites carry a `group`
(a cluster, a data centre) so that a scenario with many sites can give defaults for "same group"
and "different groups" pairs instead of listing every pair; `pairs` entries override both.

    {
      "name": "ci_small",
      "subnet": "10.213.0.0/16",
      "links": {
        "within_group": {"rtt_ms": 5, "bandwidth_mbit": 1000},
        "between_groups": {"rtt_ms": 40, "bandwidth_mbit": 100},
        "pairs": [{"sites": ["s0", "s2"], "rtt_ms": 80, "bandwidth_mbit": 50, "jitter_ms": 0, "loss_pct": 0}]
      },
      "model": {"family": "llama", "layers": 6, "hidden": 64},
      "sites": [
        {"name": "s0", "group": "g0", "processes": [{"role": "dht"}, {"role": "client", "name": "c0"}]},
        {"name": "s1", "group": "g1", "processes": [{"role": "server", "name": "a", "blocks": "0:3"}]}
      ]
    }

A site with `"nat": true` is a home network: its processes run behind a masquerading router whose
address is the site's address, and nothing can connect in (see topology.py).

Roles: `dht` (the bootstrap peer; exactly one), `scheduler`, `server`, `client` (runs a greedy
generation and checks it), `command` (any argv; `{dht}` is replaced by the DHT's multiaddr).
Per-role keys are documented in README.md. Addresses come from `subnet` (a private range that is
used only inside the namespaces): site i gets host address i + 1.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROLES = ("dht", "scheduler", "server", "client", "command")
_LINK_KEYS = {"rtt_ms", "bandwidth_mbit", "jitter_ms", "loss_pct"}


class ScenarioError(ValueError):
    """The scenario file is malformed; the message says where."""


@dataclass(frozen=True)
class LinkSpec:
    """One direction-symmetric pair of sites: RTT (each direction gets half), rate per direction."""

    rtt_ms: float
    bandwidth_mbit: float
    jitter_ms: float = 0.0  # per direction, uniform in [-jitter, +jitter] (never reorders a flow)
    loss_pct: float = 0.0  # per direction

    @property
    def one_way_s(self) -> float:
        return self.rtt_ms / 2e3


@dataclass(frozen=True)
class ProcessSpec:
    name: str
    role: str
    site: str
    options: dict = field(default_factory=dict)  # role-specific keys (blocks, memory, argv, ...)


@dataclass(frozen=True)
class Site:
    name: str
    group: str
    index: int
    address: str  # on the emulated internet; behind NAT, the router's (public) address
    nat: bool = False  # a home network: its machine sits behind a masquerading router, no inbound

    @property
    def lan_address(self) -> str:
        """Where the site's processes listen: its own address, or behind NAT a private one that no
        other site can route to (100.64.0.0/10 never overlaps the private `subnet`)."""
        return str(self.lan_network[2]) if self.nat else self.address

    @property
    def lan_network(self) -> ipaddress.IPv4Network:
        return ipaddress.ip_network(f"100.64.{self.index}.0/24")


@dataclass(frozen=True)
class Scenario:
    name: str
    subnet: str
    sites: tuple[Site, ...]
    processes: tuple[ProcessSpec, ...]
    within_group: LinkSpec | None
    between_groups: LinkSpec | None
    pair_overrides: dict[frozenset, LinkSpec]
    model: dict
    extra: dict  # keys the emulator does not interpret (experiment settings live here)

    def site(self, name: str) -> Site:
        for site in self.sites:
            if site.name == name:
                return site
        raise ScenarioError(f"no site named {name!r}")

    def link(self, a: str, b: str) -> LinkSpec:
        """The pair's link: an explicit `pairs` entry, else the group default."""
        if a == b:
            raise ScenarioError(f"a site has no link to itself ({a})")
        key = frozenset((a, b))
        if key in self.pair_overrides:
            return self.pair_overrides[key]
        same = self.site(a).group == self.site(b).group
        spec = self.within_group if same else self.between_groups
        if spec is None:
            kind = "within_group" if same else "between_groups"
            raise ScenarioError(f"no link given for {a} <-> {b}: add a pairs entry or links.{kind}")
        return spec

    def pairs(self) -> list[tuple[Site, Site, LinkSpec]]:
        """Every unordered pair once, in site order."""
        result = []
        for i, a in enumerate(self.sites):
            for b in self.sites[i + 1 :]:
                result.append((a, b, self.link(a.name, b.name)))
        return result

    def processes_of(self, role: str) -> list[ProcessSpec]:
        return [p for p in self.processes if p.role == role]


def _link(raw: object, where: str) -> LinkSpec:
    if not isinstance(raw, dict):
        raise ScenarioError(f"{where}: expected an object with rtt_ms and bandwidth_mbit")
    unknown = set(raw) - _LINK_KEYS - {"sites"}
    if unknown:
        raise ScenarioError(f"{where}: unknown keys {sorted(unknown)}")
    try:
        spec = LinkSpec(
            rtt_ms=float(raw["rtt_ms"]),
            bandwidth_mbit=float(raw["bandwidth_mbit"]),
            jitter_ms=float(raw.get("jitter_ms", 0.0)),
            loss_pct=float(raw.get("loss_pct", 0.0)),
        )
    except KeyError as error:
        raise ScenarioError(f"{where}: missing {error.args[0]}") from None
    except (TypeError, ValueError) as error:
        raise ScenarioError(f"{where}: {error}") from None
    if not (
        spec.rtt_ms >= 0 and spec.bandwidth_mbit > 0 and spec.jitter_ms >= 0 and 0 <= spec.loss_pct < 100
    ):
        raise ScenarioError(
            f"{where}: need rtt_ms >= 0, bandwidth_mbit > 0, jitter_ms >= 0, 0 <= loss_pct < 100"
        )
    if spec.jitter_ms > spec.rtt_ms / 2:
        raise ScenarioError(f"{where}: jitter_ms must not exceed the one-way delay (rtt_ms / 2)")
    return spec


def parse_scenario(raw: dict, source: str = "scenario") -> Scenario:
    if not isinstance(raw, dict):
        raise ScenarioError(f"{source}: the top level must be an object")
    subnet = raw.get("subnet", "10.213.0.0/16")
    try:
        network = ipaddress.ip_network(subnet)
    except ValueError as error:
        raise ScenarioError(f"{source}: subnet: {error}") from None
    if network.version != 4 or not _usable(network):
        raise ScenarioError(
            f"{source}: subnet must be a unicast IPv4 range (not loopback, link-local, multicast or "
            f"100.64.0.0/10, which NAT sites use inside), got {subnet}"
        )
    raw_sites = raw.get("sites")
    if not isinstance(raw_sites, list) or len(raw_sites) < 2:
        raise ScenarioError(f"{source}: sites must be a list of at least two sites")
    if len(raw_sites) + 2 > network.num_addresses:
        raise ScenarioError(f"{source}: subnet {subnet} is too small for {len(raw_sites)} sites")
    sites, processes, names = [], [], set()
    for index, entry in enumerate(raw_sites):
        where = f"{source}: sites[{index}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ScenarioError(f"{where}: each site needs a name")
        name = entry["name"]
        if not name.replace("-", "").replace("_", "").isalnum() or len(name) > 24:
            raise ScenarioError(f"{where}: site names are letters, digits, '-' and '_' (at most 24)")
        if name in names:
            raise ScenarioError(f"{where}: duplicate site {name!r}")
        names.add(name)
        unknown = set(entry) - {"name", "group", "processes", "note", "nat"}
        if unknown:
            raise ScenarioError(f"{where}: unknown keys {sorted(unknown)}")
        nat = entry.get("nat", False)
        if not isinstance(nat, bool):
            raise ScenarioError(f"{where}: nat must be true or false")
        if nat and index > 255:
            raise ScenarioError(f"{where}: at most the first 256 sites can be behind NAT")
        sites.append(Site(name, str(entry.get("group", name)), index, str(network[index + 1]), nat))
        for p_index, proc in enumerate(entry.get("processes", [])):
            p_where = f"{where}.processes[{p_index}]"
            if not isinstance(proc, dict) or proc.get("role") not in ROLES:
                raise ScenarioError(f"{p_where}: role must be one of {', '.join(ROLES)}")
            role = proc["role"]
            if nat and role in ("dht", "scheduler"):
                raise ScenarioError(f"{p_where}: a {role} behind NAT cannot be reached by anyone")
            options = {k: v for k, v in proc.items() if k not in ("role", "name")}
            processes.append(ProcessSpec(str(proc.get("name", f"{role}-{name}")), role, name, options))
    process_names = [p.name for p in processes]
    if len(set(process_names)) != len(process_names):
        raise ScenarioError(f"{source}: process names must be unique, got {process_names}")
    if len([p for p in processes if p.role == "dht"]) > 1:
        raise ScenarioError(f"{source}: at most one dht process")
    links = raw.get("links", {})
    if not isinstance(links, dict):
        raise ScenarioError(f"{source}: links must be an object")
    unknown = set(links) - {"within_group", "between_groups", "pairs"}
    if unknown:
        raise ScenarioError(f"{source}: links: unknown keys {sorted(unknown)}")
    within = (
        _link(links["within_group"], f"{source}: links.within_group") if "within_group" in links else None
    )
    between = (
        _link(links["between_groups"], f"{source}: links.between_groups")
        if "between_groups" in links
        else None
    )
    overrides: dict[frozenset, LinkSpec] = {}
    for p_index, pair in enumerate(links.get("pairs", [])):
        where = f"{source}: links.pairs[{p_index}]"
        members = pair.get("sites") if isinstance(pair, dict) else None
        if not isinstance(members, list) or len(members) != 2 or members[0] == members[1]:
            raise ScenarioError(f"{where}: sites must name two different sites")
        for member in members:
            if member not in names:
                raise ScenarioError(f"{where}: unknown site {member!r}")
        overrides[frozenset(members)] = _link(pair, where)
    scenario = Scenario(
        name=str(raw.get("name", source)),
        subnet=str(network),
        sites=tuple(sites),
        processes=tuple(processes),
        within_group=within,
        between_groups=between,
        pair_overrides=overrides,
        model=dict(raw.get("model", {})),
        extra={k: v for k, v in raw.items() if k not in ("name", "subnet", "sites", "links", "model")},
    )
    if any(site.nat for site in sites) and network.is_private:
        # libp2p advertises relay addresses only for relays with public addresses (and its DHT
        # shares only public ones), so an emulated internet with NAT behind it must look public;
        # the namespaces have no route out, so nothing is ever sent to the real owners
        raise ScenarioError(
            f"{source}: a scenario with NAT sites needs a public-looking subnet (e.g. 11.213.0.0/16), "
            f"got the private {subnet}"
        )
    scenario.pairs()  # every pair must resolve to a link now, not halfway through building the network
    return scenario


def _usable(network: ipaddress.IPv4Network) -> bool:
    cgnat = ipaddress.ip_network("100.64.0.0/10")
    return not (
        network.is_loopback
        or network.is_link_local
        or network.is_multicast
        or network.is_unspecified
        or network.is_reserved
        or network.overlaps(cgnat)
    )


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ScenarioError(
                f"{path}: reading YAML needs PyYAML (pip install pyyaml), or use JSON"
            ) from None
        raw = yaml.safe_load(text)
    else:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as error:
            raise ScenarioError(f"{path}: {error}") from None
    return parse_scenario(raw, str(path))


def equidistant_scenario(
    name: str, sites: Sequence[str], rtt_ms: float, bandwidth_mbit: float = 100.0
) -> Scenario:
    """Every site `rtt_ms` (round trip) and `bandwidth_mbit` from every other, each its own group,
    the DHT at the first site: the emulated internet of the benchmarks that measure round trips."""
    return parse_scenario(
        {
            "name": name,
            "links": {"between_groups": {"rtt_ms": rtt_ms, "bandwidth_mbit": bandwidth_mbit}},
            "sites": [
                {
                    "name": site,
                    "group": site,
                    "processes": [{"role": "dht", "name": "dht"}] if index == 0 else [],
                }
                for index, site in enumerate(sites)
            ],
        },
        name,
    )
