"""Discrete-event simulation of a Plan on a machine model.

Owns ``Machine`` (device links, P2P, a shared host link, CPU optimizer throughput; presets in
``presets/*.json``), ``simulate`` -> ``SimResult`` (makespan, steady-state iteration, bubble
ratio, per-device timelines, peak device memory, bytes moved), ``quick_times`` (the fast
compute-only timing pass the partitioner uses). ``python -m rp_engine.plan.simulate`` runs the
command line of cli.py (``__main__.py``: this package never imports it).

Modules, in import order: machine.py (``Machine``, presets), results.py (``SimResult``,
``Interval``), quick.py (the fast pass), events.py (tasks, lanes, links: the event loop), run.py
(``simulate`` and the result it assembles).

Model. Each device has a compute stream that runs its plan actions strictly in order, and three
copy streams: weight uploads (H2D), activation uploads (H2D) and downloads (D2H). Copy streams
serve transfers in the order they become ready; concurrent transfers share link bandwidth
(per-device H2D and D2H links, an optional host link shared by every device, P2P links). The
host runs optimizer steps one at a time, and a plan's READs (weights from NVMe) one at a time
in issue order on one host-wide "nvme" lane at ``Machine.nvme_read_gbps`` (and the host link,
when there is one); the UPLOAD a READ feeds starts once it has finished. Without a machine (the
simulation conventions of the published bubble table) only compute takes time and every
cross-device edge adds ``comm_ms``.

Activations of an offloaded plan move as the runtime moves them (plan/traffic.py): besides the
SENDs of cross-device edges, a backward stage's input is stashed on the host after its forward
(D2H on the producer's device) and uploaded again for its recompute (H2D), even on the same
device; the micro-batch itself is uploaded for forward stage 0 and the recompute of layer 0.

Host overhead (``Machine.action_overhead_ms``, default 0): each action occupies the lane that
runs it for that long before its work starts - a compute action its device's compute stream,
each copy (each half of a send through the host) its copy stream, an optimizer step the host's
CPU lane. It stands for what the runtime pays per action that no layer timing or link model
contains (Python issue and bookkeeping, thread hand-offs); it is not compute busy time. With
``Machine.serial_overhead`` the overheads of all lanes instead take turns on one host lane (in
the order they become ready; a compute action's once its inputs are there and the action before
it on its device has finished), and the action starts when its overhead has run: Python work
holds one interpreter lock whichever thread does it, while the kernels and copies do not.

Shared cores (``Machine.host_cores``, CPU virtual devices): a device's compute, the optimizer
and the host overhead all run on the same few cores. Each is then work in core-ms (a device's
profiled time x its share of the cores, the pool's intra-op split; an optimizer step's time x
all cores, as DeepSpeed's CPU Adam was timed; the overhead x one core), served like bytes on a
link: at most its own cores, and an equal share of the host's when more want them than exist.
On a shared host, ``Machine.host_share[k - 1]`` is the cores' worth the run gets while k of its
tasks want them (other processes take the rest; measured during a run); k beyond the table
takes its last entry.

A backward action is two phases: recompute (needs the saved input) and backward (needs the
upstream gradient). RoundPipe starts the recompute as soon as its input exists ("early"); bound
schedules run it after the gradient arrives, as the published conventions do. For display and
the fill/drain figure the early recompute is aligned to end when the gradient arrives:

    d3: |..........|RRRRRR|BBBBBBBBBBB|      recompute ends as the gradient arrives
                        ^ gradient
"""

from __future__ import annotations

from .machine import Machine, load_machine, preset_names
from .quick import (
    ASYNC_ITERATIONS,
    QuickProgram,
    QuickTimes,
    WeightTraffic,
    async_steady_ms,
    quick_times,
)
from .results import Interval, SimResult
from .run import simulate

__all__ = [
    "Machine",
    "Interval",
    "SimResult",
    "simulate",
    "QuickTimes",
    "WeightTraffic",
    "quick_times",
    "QuickProgram",
    "ASYNC_ITERATIONS",
    "async_steady_ms",
    "load_machine",
    "preset_names",
]
