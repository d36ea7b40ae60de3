"""Kernels per layer of a compiled program, counted from its HLO text: how many launches one layer of the
engine's decode program makes (``bench engine``'s ``kernels_per_layer`` and ``attention_loop_kernels``)."""

from __future__ import annotations

import re
from typing import Any

# Instructions that launch no work of their own.
_FREE_OPS = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
                       "opt-barrier", "partition-id", "replica-id"})
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?[\w.\-]+ = .*?\s([a-z][a-z0-9\-]*)\(")


def _op_name(line: str) -> str:
    found = re.search(r'op_name="([^"]*)"', line)
    return found.group(1) if found else ""


def _computations(hlo_text: str) -> dict[str, list[tuple[str, str]]]:
    """Each computation of an HLO module's text: its (opcode, line) in order."""
    out: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
        if head and not line.startswith(" "):
            current = out.setdefault(head.group(1), [])
            continue
        op = _INSTRUCTION.match(line)
        if op and current is not None:
            current.append((op.group(1), line))
    return out


def layer_kernels(hlo_text: str, num_layers: int, inner: str = "") -> dict[str, Any] | None:
    """Kernels (instructions that launch work) per layer of a compiled program whose layers run in one scan:
    the body of the while loop XLA found ``num_layers`` trips for. ``per_layer`` counts the body's own kernels,
    its loops aside; ``inner_loops`` has, per loop inside it whose op name holds ``inner`` (a name scope; the
    live-reading attention's tile groups), in program order, ``[body, condition]``: the kernels one trip runs
    and those one test of its condition runs (a loop tests it once per trip and once more to stop). Other loops
    XLA placed in the layer count once with its kernels. None when no such loop is found (XLA unrolled it)."""
    comps = _computations(hlo_text)
    trips = re.compile(r'known_trip_count":\{"n":"(\d+)"')
    body_of, cond_of = re.compile(r"body=%?([\w.\-]+)"), re.compile(r"condition=%?([\w.\-]+)")
    called = re.compile(r"to_apply=%?([\w.\-]+)")

    def inline(name):  # a computation's instructions, those of the computations it calls in their place
        out = []
        for o, x in comps.get(name, []):
            out += inline(called.search(x).group(1)) if o == "call" and called.search(x) else [(o, x)]
        return out

    def kernels(name):
        return sum(o not in _FREE_OPS for o, _ in inline(name))

    found = []
    for ops in comps.values():
        for op, line in ops:
            n = trips.search(line)
            if op == "while" and n and int(n.group(1)) == num_layers:
                body = inline(body_of.search(line).group(1))
                counted = [x for o, x in body if o == "while" and inner in _op_name(x)]
                loops = [[kernels(body_of.search(x).group(1)), kernels(cond_of.search(x).group(1))] for x in counted]
                other = [kernels(body_of.search(x).group(1)) + kernels(cond_of.search(x).group(1))
                         for o, x in body if o == "while" and x not in counted]
                found.append({"per_layer": sum(o not in _FREE_OPS and o != "while" for o, _ in body) + sum(other),
                              "inner_loops": loops})
    # Other loops may take as many trips (XLA:CPU runs a scatter over a few rows as one): the layers' loop is the
    # one holding the scoped loops, else the largest.
    return max(found, key=lambda x: (len(x["inner_loops"]), x["per_layer"]), default=None)
