"""The data file of published figures (runtime/simulation/data/figures.json), read once."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

PATH = Path(__file__).with_name("data") / "figures.json"

#: data files the process reads in place of the package's (path -> text): what `fabric-calibrate`
#: is fitting, which the engine's runs read while the files stay as they are until the end
override: dict[Path, str] = {}


def data_text(path: Path) -> str | None:
    """The text of one of the package's data files (None where there is none)."""
    if path in override:
        return override[path]
    return path.read_text() if path.is_file() else None


@lru_cache(maxsize=1)
def figures() -> dict:
    return json.loads(data_text(PATH))


def default(kind: str) -> dict:
    """The default figure set for a device or link kind, e.g. default('gpu')."""
    f = figures()
    name = f["defaults"][kind]
    for group in ("gpu", "links", "cxl", "dpu"):
        if name in f[group]:
            return f[group][name]
    raise KeyError(name)


#: the figure set each link kind takes for what a link leaves out; other kinds take the
#: default link's
LINK_FIGURE = {"nvlink": "nvlink4", "pcie": "pcie5_x16", "cxl": "cxl2_x16"}


def link_figure(kind: str | None) -> dict:
    """The figures (``bw``, ``latency``, ``setup``) of a link of ``kind`` that gives none."""
    f = figures()
    return f["links"][LINK_FIGURE.get(kind, f["defaults"]["link"])]


def time_inside(kind: str, props: dict) -> float:
    """The time a chunk spends crossing a device of ``kind`` with ``props`` (its declared
    properties, as numbers), added to each link it leaves by: a CXL switch's `hop` (else the
    figure's), a DPU's or NIC's `latency` (else none; it also delays leaving on the wire)."""
    if kind == "cxl_switch":
        hop = props.get("hop")
        return hop if hop is not None else default("switch_hop")["latency"]
    if kind in ("dpu", "nic"):
        return props.get("latency") or 0
    return 0
