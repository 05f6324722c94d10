"""Plans as data: pipeline actions, their text form, and the Plan that orders them.

Owns ``Op``, ``Action`` (text form ``F3.1@2``: op, stage, micro-batch, device; ``#1`` suffix for
iteration 1; ``@h`` for the host), ``Plan`` (a global issue order plus metadata), the data-flow
rules that derive every action's dependencies (``Plan.deps``), the device x step grid used by
golden files and error messages, and ``PlanError``. No torch, no timing: see simulate/.

Stage numbering (shared with the runtime). The model is L decoder layers plus a prefix (in forward
stage 0) and a head. Forward stage s covers ``fwd_cuts[s]`` layers, in order. Backward stage 0
holds the head plus the last ``bwd_cuts[0]`` layers; backward stage j >= 1 holds the next
``bwd_cuts[j]`` layers going toward the input. A plan with HEAD actions fuses head forward, loss
and head backward into backward stage 0 (RoundPipe, Mobius); a plan whose backward stage 0 is a
BWD action ran the head forward inside the last FWD stage (GPipe, 1F1B, interleaved, looped BFS,
where forward stage s and backward stage S-1-s are the same bound stage).

Transfer actions name a *slot*: slot s < S_f is forward stage s, slot S_f + j is backward stage j.
  UPLOAD(slot, m0)@d   weights of the slot's layers to device d, for the group of consecutive
                       compute actions of that slot on d starting with micro-batch m0
  FREE(slot, m0)@d     release of those weights (and gradients)
  DOWNLOAD(slot, m0)@d weight gradients of a backward group back to the host

Residency: in a lowered plan, a compute group with no UPLOAD of its own runs on the weights of
the latest earlier group of the same slot and iteration on its device (they stayed resident).
That group and the ones joining it form one *holding* (``weight_holdings``): one UPLOAD, one
DOWNLOAD of the gradients accumulated over all its groups, one FREE after its last group.
  SEND(slot, m)@d      the output of compute action (slot, m) moved to device d (via the host,
                       or peer to peer), for the consumers of it on d
  OPT(layer, 0)@h      CPU optimizer step of one layer (layer L = the head)
  READ(slot, m0)@d     the slot's weights read from NVMe into a host staging buffer, for the
                       UPLOAD(slot, m0)@d it feeds (slots whose weights live on NVMe: a lowered
                       plan's ``nvme_slots``). The device names the UPLOAD fed; the read itself
                       is host work, on one host-wide NVMe lane (grid row "nvme").

NVMe reads (``Plan.nvme_slots``, ``Plan.nvme_read_ahead`` = R): the UPLOAD waits for its READ;
the READs form one FIFO (each waits for the READ before it in issue order) over a pool of R host
staging buffers, so READ k (the k-th READ in issue order) also waits for the UPLOAD fed by READ
k - R: that copy out of the staging buffer READ k reuses has finished.
"""

from __future__ import annotations

import enum
import functools
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from rp_engine.host.units import format_bytes

__all__ = [
    "HOST",
    "OPTIMIZER_LAG",
    "COMPUTE_OPS",
    "Op",
    "Action",
    "Plan",
    "PlanError",
    "parse_action",
    "format_grid",
    "format_bytes",
    "compute_groups",
    "Holding",
    "weight_holdings",
]

HOST = -1  # device index of host-side actions (the CPU optimizer)
# iteration i computes on the weights of optimizer step i - lag: the previous step (sync) or the
# one before it (async, staleness 1: step i-1 runs on the CPU while iteration i computes)
OPTIMIZER_LAG = {"sync": 1, "async": 2}


class Op(enum.Enum):
    """What an action does; the value is its one-letter text form."""

    FWD = "F"  # forward of a forward stage (no autograd graph kept)
    BWD = "B"  # recompute + backward of a backward stage
    HEAD = "H"  # fused head forward + loss + backward (backward stage 0), no recompute
    UPLOAD = "U"  # weight upload host -> device
    DOWNLOAD = "D"  # weight-gradient download device -> host
    SEND = "S"  # activation / activation-gradient transfer to another device
    OPT = "O"  # optimizer step of one layer on the host
    FREE = "X"  # release of an upload's weights on the device
    READ = "R"  # weights of an NVMe slot read into a host staging buffer, before their UPLOAD

    # members are singletons: identity hashing is correct and far cheaper than Enum.__hash__,
    # which matters because plans hash thousands of actions
    __hash__ = object.__hash__


COMPUTE_OPS = frozenset({Op.FWD, Op.BWD, Op.HEAD})
_OP_BY_LETTER = {op.value: op for op in Op}
_ACTION_RE = re.compile(r"^([A-Z])(\d+)\.(\d+)@(h|\d+)(?:#(\d+))?$")


class PlanError(ValueError):
    """An impossible or inconsistent plan. The message carries the device x step grid."""


@dataclass(frozen=True, slots=True)
class Action:
    """One unit of work: ``op`` on ``stage`` for ``microbatch`` on ``device`` in ``iteration``."""

    op: Op
    stage: int
    microbatch: int
    device: int
    iteration: int = 0
    _hash: int = field(default=0, init=False, repr=False, compare=False)
    is_compute: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # plans hash and classify every action many times: do it once
        key = (self.op, self.stage, self.microbatch, self.device, self.iteration)
        object.__setattr__(self, "_hash", hash(key))
        object.__setattr__(self, "is_compute", self.op in COMPUTE_OPS)

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[type, tuple[Op, int, int, int, int]]:
        # rebuild through __init__ so the cached hash is recomputed in the receiving process
        return (Action, (self.op, self.stage, self.microbatch, self.device, self.iteration))

    def __str__(self) -> str:
        where = "h" if self.device == HOST else str(self.device)
        suffix = f"#{self.iteration}" if self.iteration else ""
        return f"{self.op.value}{self.stage}.{self.microbatch}@{where}{suffix}"


def parse_action(text: str) -> Action:
    """Inverse of ``str(action)``: ``parse_action("B3.1@2#1") == Action(Op.BWD, 3, 1, 2, 1)``."""
    match = _ACTION_RE.match(text.strip())
    if match is None or match.group(1) not in _OP_BY_LETTER:
        raise ValueError(f"not an action: {text!r} (expected e.g. 'F3.1@2' or 'O5.0@h#1')")
    letter, stage, mb, where, it = match.groups()
    device = HOST if where == "h" else int(where)
    return Action(_OP_BY_LETTER[letter], int(stage), int(mb), device, int(it or 0))


@dataclass(frozen=True)
class Plan:
    """A schedule as data.

    ``actions`` is the global issue order: a topological order of ``deps`` in which each device's
    actions appear in that device's execution order. ``deps[a]`` lists the actions ``a`` waits for
    beyond its own device's order (derived from the data-flow rules in the module docstring, so a
    plan is fully described by its actions and metadata, which is what the text form stores).
    ``optimizer`` ("sync", "async" or "") says which optimizer step an UPLOAD waits for:
    the previous iteration's (sync) or the one before (async, staleness 1).
    """

    actions: tuple[Action, ...]
    num_devices: int
    num_microbatches: int
    fwd_cuts: tuple[int, ...]
    bwd_cuts: tuple[int, ...]
    schedule: str = "custom"
    next_start_device: int = 0
    optimizer: str = ""
    # weight groups a device may hold beyond the one computing: an UPLOAD of group g waits for
    # the FREE of group g - 1 - prefetch_depth on its device (lowered plans; chosen by the
    # planner from the memory budget)
    prefetch_depth: int = 1
    # where the weights live, set by the schedule's builder (and kept by lowering), so behaviour
    # is keyed on these properties and not on the schedule's name: ``offloaded`` weights live on
    # the host and are uploaded per slot (RoundPipe, Mobius); ``bound`` stages stay on one device
    # (stage k on a fixed device: GPipe, 1F1B, interleaved, looped BFS, Mobius)
    offloaded: bool = False
    bound: bool = False
    # slots whose weights live on NVMe (lowered plans): each of their UPLOADs is fed by a READ;
    # nvme_read_ahead: host staging buffers the READs cycle through (how far ahead they run)
    nvme_slots: tuple[int, ...] = ()
    nvme_read_ahead: int = 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", tuple(self.actions))
        object.__setattr__(self, "fwd_cuts", tuple(int(c) for c in self.fwd_cuts))
        object.__setattr__(self, "bwd_cuts", tuple(int(c) for c in self.bwd_cuts))
        if sum(self.fwd_cuts) != sum(self.bwd_cuts):
            raise PlanError(
                f"fwd_cuts {list(self.fwd_cuts)} and bwd_cuts {list(self.bwd_cuts)} cover "
                f"{sum(self.fwd_cuts)} and {sum(self.bwd_cuts)} layers; they must cover the same L"
            )
        if not self.fwd_cuts or not self.bwd_cuts:
            raise PlanError("a plan needs at least one forward and one backward stage")
        if self.optimizer not in ("", "sync", "async"):
            raise PlanError(f"optimizer must be '', 'sync' or 'async', got {self.optimizer!r}")
        if self.prefetch_depth < 0:
            raise PlanError(f"prefetch_depth must be >= 0, got {self.prefetch_depth}")
        object.__setattr__(self, "nvme_slots", tuple(sorted({int(s) for s in self.nvme_slots})))
        if self.nvme_read_ahead < 1:
            raise PlanError(f"nvme_read_ahead must be >= 1, got {self.nvme_read_ahead}")

    # ---- shape -------------------------------------------------------------------------------
    @property
    def num_fwd_stages(self) -> int:
        return len(self.fwd_cuts)

    @property
    def num_bwd_stages(self) -> int:
        return len(self.bwd_cuts)

    @property
    def num_layers(self) -> int:
        return sum(self.fwd_cuts)

    @property
    def num_slots(self) -> int:
        return self.num_fwd_stages + self.num_bwd_stages

    @functools.cached_property
    def fused_head(self) -> bool:
        """True when backward stage 0 is a HEAD action (head forward fused into the backward)."""
        return any(a.op is Op.HEAD for a in self.actions)

    @functools.cached_property
    def iterations(self) -> tuple[int, ...]:
        return tuple(sorted({a.iteration for a in self.actions}))

    def slot(self, action: Action) -> int:
        """Slot of a compute action: forward stage s -> s, backward stage j -> S_f + j."""
        if action.op is Op.FWD:
            return action.stage
        if action.op in (Op.BWD, Op.HEAD):
            return self.num_fwd_stages + action.stage
        return action.stage  # transfer actions already name a slot

    def slot_layers(self, slot: int) -> range:
        """Decoder layers of a slot (backward stage 0 also holds the head)."""
        return self._slot_ranges[slot]

    @functools.cached_property
    def _slot_ranges(self) -> tuple[range, ...]:
        ranges, start = [], 0
        for n in self.fwd_cuts:
            ranges.append(range(start, start + n))
            start += n
        end = self.num_layers
        for n in self.bwd_cuts:
            ranges.append(range(end - n, end))
            end -= n
        return tuple(ranges)

    def per_device(self, device: int) -> list[Action]:
        """Actions of one device (``HOST`` for the optimizer) in execution order (a READ is
        listed under the device of the UPLOAD it feeds, though the host runs it)."""
        return list(self._by_device.get(device, ()))

    @functools.cached_property
    def _by_device(self) -> dict[int, tuple[Action, ...]]:
        rows: dict[int, list[Action]] = defaultdict(list)
        for action in self.actions:
            rows[action.device].append(action)
        return {d: tuple(r) for d, r in rows.items()}

    @functools.cached_property
    def deps(self) -> Mapping[Action, tuple[Action, ...]]:
        """Cross-action dependencies (same-device order is implied by ``per_device``)."""
        return _derive_deps(self)

    def is_grad_edge(self, consumer: Action, dep: Action) -> bool:
        """True when ``dep`` delivers the upstream gradient of ``consumer`` (a backward action).

        A backward stage's recompute needs only its saved input; its backward part needs this.
        """
        if consumer.op is not Op.BWD:
            return False
        if dep.op is Op.SEND:
            return dep.stage >= self.num_fwd_stages or (
                consumer.stage == 0 and dep.stage == self.num_fwd_stages - 1
            )
        if dep.op in (Op.BWD, Op.HEAD):
            return True
        # unfused head: the loss comes from the last forward stage
        return dep.op is Op.FWD and consumer.stage == 0 and dep.stage == self.num_fwd_stages - 1

    # ---- text form ---------------------------------------------------------------------------
    def to_text(self) -> str:
        """Header, one row per device (execution order) and the global issue order.

        The issue order is the sequence of device rows actions are taken from, run-length
        encoded ("0x4 1x4" = four from device 0, then four from device 1).
        """
        header = (
            f"# plan schedule={self.schedule} devices={self.num_devices} "
            f"microbatches={self.num_microbatches} fwd_cuts={_csv(self.fwd_cuts)} "
            f"bwd_cuts={_csv(self.bwd_cuts)} next_start_device={self.next_start_device} "
            f"optimizer={self.optimizer or '-'}"
            + (f" prefetch={self.prefetch_depth}" if self.prefetch_depth != 1 else "")
            + (" offloaded=1" if self.offloaded else "")
            + (" bound=1" if self.bound else "")
            + (f" nvme={_csv(self.nvme_slots)}" if self.nvme_slots else "")
            + (f" read_ahead={self.nvme_read_ahead}" if self.nvme_read_ahead != 2 else "")
        )
        lines = [header, format_grid(self)]
        lines.append("issue: " + " ".join(_run_length(_grid_row(a) for a in self.actions)))
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> Plan:
        """Inverse of ``to_text``."""
        lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
        if not lines or not lines[0].startswith("# plan "):
            raise ValueError("plan text must start with a '# plan ...' header line")
        meta = dict(item.split("=", 1) for item in lines[0][len("# plan ") :].split())
        rows: dict[str, list[Action]] = {}
        issue: list[str] = []
        for line in lines[1:]:
            name, _, rest = line.partition(":")
            if name == "issue":
                issue = _run_length_decode(rest.split())
            else:
                rows[name.strip()] = [parse_action(tok) for tok in rest.split() if tok != "."]
        if sorted(issue) != sorted(n for n, row in rows.items() for _ in row):
            raise ValueError("plan text: the 'issue:' line must take every action of every row")
        cursors = {name: iter(row) for name, row in rows.items()}
        actions = tuple(next(cursors[name]) for name in issue)
        return cls(
            actions=actions,
            num_devices=int(meta["devices"]),
            num_microbatches=int(meta["microbatches"]),
            fwd_cuts=_parse_csv(meta["fwd_cuts"]),
            bwd_cuts=_parse_csv(meta["bwd_cuts"]),
            schedule=meta.get("schedule", "custom"),
            next_start_device=int(meta.get("next_start_device", 0)),
            optimizer="" if meta.get("optimizer", "-") == "-" else meta["optimizer"],
            prefetch_depth=int(meta.get("prefetch", 1)),
            offloaded=meta.get("offloaded", "0") == "1",
            bound=meta.get("bound", "0") == "1",
            nvme_slots=_parse_csv(meta.get("nvme", "")),
            nvme_read_ahead=int(meta.get("read_ahead", 2)),
        )


def format_grid(plan: Plan, *, mark: Action | None = None, limit: int | None = None) -> str:
    """Device x step grid (one row per device, actions in execution order; the host's OPTs on
    row "h", the READs from NVMe on row "nvme", in issue order).

    ``mark`` is shown as ``>>F3.1@2<<`` (the failing step in an error); ``limit`` trims each row
    to the steps around the mark (or the first ``limit`` steps) so errors stay readable.
    """
    rows = []
    for name, row in _grid_rows(plan).items():
        cells = [f">>{a}<<" if a == mark else str(a) for a in row]
        if limit is not None and len(cells) > limit:
            centre = row.index(mark) if mark in row else limit // 2
            lo = max(0, min(centre - limit // 2, len(cells) - limit))
            cells = (["..."] if lo else []) + cells[lo : lo + limit]
            cells += ["..."] if lo + limit < len(row) else []
        rows.append(f"{name}: " + " ".join(cells))
    return "\n".join(rows)


def _grid_rows(plan: Plan) -> dict[str, list[Action]]:
    """The grid's rows by name: devices, then the host ("h"), then the NVMe reads ("nvme")."""
    rows: dict[str, list[Action]] = {}
    for d in sorted(plan._by_device, key=lambda d: (d == HOST, d)):
        row = [a for a in plan._by_device[d] if a.op is not Op.READ]
        if row:
            rows[_row_name(d)] = row
    reads = [a for a in plan.actions if a.op is Op.READ]
    if reads:
        rows[_NVME_ROW] = reads
    return rows


# ---- dependency derivation -------------------------------------------------------------------
def _derive_deps(plan: Plan) -> dict[Action, tuple[Action, ...]]:
    """Apply the data-flow rules of the module docstring to every action of ``plan``."""
    ctx = _DepContext(plan)
    deps: dict[Action, list[Action]] = {a: [] for a in plan.actions}
    for action in plan.actions:
        if action.is_compute:
            deps[action] += ctx.compute_deps(action)
    for action in plan.actions if ctx.lowered else ():
        handler = ctx.handlers.get(action.op)
        if handler is not None:
            deps[action] += handler(action)
    return {a: tuple(dict.fromkeys(d)) for a, d in deps.items()}


class _DepContext:
    """Indexes of a plan used by the dependency rules (built once per plan)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        num_fwd = plan.num_fwd_stages
        self.compute: dict[tuple[Op, int, int, int], Action] = {
            (a.op, a.stage, a.microbatch, a.iteration): a for a in plan.actions if a.is_compute
        }
        self.head_op = Op.HEAD if plan.fused_head else Op.BWD
        self.fwd_starting_at: dict[int, list[int]] = defaultdict(list)
        self.producer = [0] * (plan.num_layers + 1)  # position p -> fwd stage computing it
        for s in range(num_fwd):
            layers = plan.slot_layers(s)
            self.fwd_starting_at[layers.start].append(s)
            for layer in layers:
                self.producer[layer + 1] = s
        self.bwd_input = [plan.slot_layers(num_fwd + j).start for j in range(plan.num_bwd_stages)]
        self.lowered = any(not a.is_compute for a in plan.actions)
        if self.lowered:
            self._index_transfers()

    def _index_transfers(self) -> None:
        plan = self.plan
        self.by_key = {
            (a.op, a.stage, a.microbatch, a.device, a.iteration): a for a in plan.actions
        }
        self.by_slot = {(plan.slot(a), a.microbatch, a.iteration): a for a in self.compute.values()}
        self.groups = compute_groups(plan)
        self.group_of: dict[Action, tuple[int, int]] = {}
        self.group_index: dict[tuple[int, int, int, int], int] = {}  # (dev, slot, m0, it) -> gi
        self.slot_groups: dict[tuple[int, int], list[tuple[int, list[Action]]]] = defaultdict(list)
        for d, groups in self.groups.items():
            for gi, group in enumerate(groups):
                first = group[0]
                self.group_index[(d, plan.slot(first), first.microbatch, first.iteration)] = gi
                self.slot_groups[(plan.slot(first), first.iteration)].append((d, group))
                self.group_of.update((a, (d, gi)) for a in group)
        self.holdings = weight_holdings(plan)
        self.holding_of: dict[tuple[int, int], Holding] = {}  # (device, group index) -> holding
        for d, held in self.holdings.items():
            for h in held:
                self.holding_of.update(((d, gi), h) for gi in h.group_indices)
        self.device_compute = {
            d: [a for a in row if a.is_compute] for d, row in plan._by_device.items()
        }
        self.device_pos = {a: i for row in self.device_compute.values() for i, a in enumerate(row)}
        self.send_consumers: dict[Action, list[Action]] = defaultdict(list)
        self.reads = [a for a in plan.actions if a.op is Op.READ]  # the FIFO, in issue order
        self.read_index = {r: k for k, r in enumerate(self.reads)}
        self.handlers = {
            Op.READ: self.read_deps,
            Op.UPLOAD: self.upload_deps,
            Op.FREE: self.free_deps,
            Op.DOWNLOAD: self.download_deps,
            Op.SEND: self.send_deps,
            Op.OPT: self.opt_deps,
        }

    # -- compute ---------------------------------------------------------------------------------
    def compute_deps(self, a: Action) -> list[Action]:
        if not self.lowered:
            return self.data_sources(a)
        deps = [self._via_send(a, src) for src in self.data_sources(a)]
        upload = self._group_transfer(a, Op.UPLOAD)
        return deps + ([upload] if upload is not None else [])

    def data_sources(self, a: Action) -> list[Action]:
        """Compute actions whose outputs ``a`` consumes (same iteration and micro-batch)."""
        m, it, get = a.microbatch, a.iteration, self.compute.get
        if a.op is Op.FWD:
            prev = get((Op.FWD, a.stage - 1, m, it)) if a.stage > 0 else None
            return [prev] if prev is not None else []
        keys = [self.input_source(a)]
        if a.op is Op.BWD and a.stage == 0:
            keys.append((Op.FWD, self.plan.num_fwd_stages - 1, m, it))  # loss from the head
        elif a.op is Op.BWD:
            keys.append((self.head_op if a.stage == 1 else Op.BWD, a.stage - 1, m, it))
        return self._present(keys)

    def input_source(self, a: Action) -> tuple[Op, int, int, int]:
        """Producer of a backward stage's saved input (the hidden state entering its layers).

        A bound stage keeps its forward input on its device (source: its own FWD); otherwise
        the input comes from the forward stage that computed it (the prefix output for p == 0).
        """
        p = self.bwd_input[a.stage]
        m, it = a.microbatch, a.iteration
        for s in self.fwd_starting_at.get(p, ()):
            fwd = self.compute.get((Op.FWD, s, m, it))
            if fwd is not None and fwd.device == a.device:
                return (Op.FWD, s, m, it)
        return (Op.FWD, self.producer[p], m, it)

    def _present(self, keys: Iterable[tuple[Op, int, int, int]]) -> list[Action]:
        found = (self.compute.get(k) for k in keys)
        return list(dict.fromkeys(a for a in found if a is not None))

    def _via_send(self, consumer: Action, src: Action) -> Action:
        if src.device == consumer.device:
            return src
        key = (Op.SEND, self.plan.slot(src), src.microbatch, consumer.device, src.iteration)
        send = self.by_key.get(key)
        if send is None:
            return src
        self.send_consumers[send].append(consumer)
        return send

    # -- groups and transfers --------------------------------------------------------------------
    def _group_transfer(self, a: Action, op: Op) -> Action | None:
        """The UPLOAD (or other transfer) of the holding ``a``'s group runs on."""
        d, gi = self.group_of[a]
        h = self.holding_of.get((d, gi))
        return h.transfer(op) if h is not None else None

    def _holding(self, t: Action) -> Holding | None:
        gi = self.group_index.get((t.device, t.stage, t.microbatch, t.iteration))
        return None if gi is None else self.holding_of.get((t.device, gi))

    def read_deps(self, r: Action) -> list[Action]:
        """The READ before it (one FIFO) and the UPLOAD fed by the READ ``nvme_read_ahead``
        back, whose copy out of the staging buffer this READ reuses has then finished."""
        k, back = self.read_index[r], self.plan.nvme_read_ahead
        deps = [self.reads[k - 1]] if k else []
        if k >= back:
            fed = self.by_key.get((Op.UPLOAD, *_transfer_key(self.reads[k - back])))
            deps += [fed] if fed is not None else []
        return deps

    def upload_deps(self, u: Action) -> list[Action]:
        h = self._holding(u)
        read = self.by_key.get((Op.READ, *_transfer_key(u)))
        deps: list[Action] = [read] if read is not None else []
        for gate in h.gates if h is not None else ():
            if gate.free is not None:
                deps.append(gate.free)
        lag = OPTIMIZER_LAG.get(self.plan.optimizer)
        if lag is not None and u.iteration >= lag:
            for layer in self._opt_layers(u.stage):
                key = (Op.OPT, layer, 0, HOST, u.iteration - lag)
                deps += [self.by_key[key]] if key in self.by_key else []
        return deps

    def _opt_layers(self, slot: int) -> list[int]:
        layers = list(self.plan.slot_layers(slot))
        return layers + ([self.plan.num_layers] if slot == self.plan.num_fwd_stages else [])

    def free_deps(self, x: Action) -> list[Action]:
        h = self._holding(x)
        down = self.by_key.get((Op.DOWNLOAD, x.stage, x.microbatch, x.device, x.iteration))
        return (h.computes() if h else []) + ([down] if down is not None else [])

    def download_deps(self, dl: Action) -> list[Action]:
        h = self._holding(dl)
        return h.computes() if h is not None else []

    def send_deps(self, s: Action) -> list[Action]:
        src = self.by_slot.get((s.stage, s.microbatch, s.iteration))
        deps = [src] if src is not None else []
        consumers = self.send_consumers.get(s, [])
        if consumers:  # prefetch depth 1: arrive while the action before the consumer runs
            first = min(consumers, key=self.device_pos.__getitem__)
            pos = self.device_pos[first]
            if pos >= 2:
                deps.append(self.device_compute[first.device][pos - 2])
        return deps

    def opt_deps(self, o: Action) -> list[Action]:
        plan, layer = self.plan, o.stage
        deps: list[Action] = []
        for j in range(plan.num_bwd_stages):
            slot = plan.num_fwd_stages + j
            if not (layer in plan.slot_layers(slot) or (j == 0 and layer == plan.num_layers)):
                continue
            for _, group in self.slot_groups.get((slot, o.iteration), []):
                h = self.holding_of.get(self.group_of[group[0]])
                if h is not None and h.download is not None:
                    deps.append(h.download)  # a resident group's gradients go with its holding
                else:
                    deps += list(group)
        return deps


def _transfer_key(a: Action) -> tuple[int, int, int, int]:
    """(slot, m0, device, iteration): what the transfers of one holding share."""
    return (a.stage, a.microbatch, a.device, a.iteration)


def compute_groups(plan: Plan) -> dict[int, list[list[Action]]]:
    """Per device: runs of consecutive compute actions of the same slot and iteration (a slot's
    round on that device: one UPLOAD, one DOWNLOAD and one FREE each in a lowered plan)."""
    groups: dict[int, list[list[Action]]] = {}
    for d, row in plan._by_device.items():
        runs: list[list[Action]] = []
        for a in row:
            if not a.is_compute:
                continue
            if runs and (plan.slot(runs[-1][0]), runs[-1][0].iteration) == (
                plan.slot(a),
                a.iteration,
            ):
                runs[-1].append(a)
            else:
                runs.append([a])
        groups[d] = runs
    return groups


_compute_groups = compute_groups  # the former private name, kept for existing callers


@dataclass(eq=False)
class Holding:
    """One set of weights on one device in a lowered plan: an UPLOAD and the compute groups that
    run on it (the group that has the UPLOAD, then the resident ones joining it), its DOWNLOAD
    (backward slots) and FREE. ``gates``: the holdings whose FREEs this UPLOAD waits for (the
    prefetch depth's memory gate)."""

    slot: int
    device: int
    groups: list[list[Action]]
    group_indices: list[int]  # the groups' positions in the device's compute_groups
    upload: Action | None = None
    download: Action | None = None
    free: Action | None = None
    gates: list[Holding] = field(default_factory=list)

    def computes(self) -> list[Action]:
        return [a for g in self.groups for a in g]

    def transfer(self, op: Op) -> Action | None:
        return {Op.UPLOAD: self.upload, Op.DOWNLOAD: self.download, Op.FREE: self.free}.get(op)

    @property
    def first(self) -> int:
        return self.group_indices[0]

    @property
    def last(self) -> int:
        return self.group_indices[-1]


def weight_holdings(plan: Plan) -> dict[int, list[Holding]]:
    """Per device, the holdings of a lowered plan in upload order (see the module docstring).

    A group with an UPLOAD of its own starts a holding; a group without one joins the latest
    holding of its slot and iteration on that device (its weights stayed resident). The gates of
    a holding whose first group is the device's group ``gi`` are the holdings that end (have
    their last group) at or before group ``gi - 1 - prefetch_depth`` and gate no earlier
    holding: every holding gates a later upload, so none can linger unbounded; with every group
    its own holding, the group ``prefetch_depth + 1`` back, as without residency. Compute-only
    plans: one holding per group, no transfers.
    """
    keyed = {
        (a.op, a.stage, a.microbatch, a.device, a.iteration): a
        for a in plan.actions
        if a.op in (Op.UPLOAD, Op.DOWNLOAD, Op.FREE)
    }
    lowered = any(op is Op.UPLOAD for op, *_ in keyed)
    back = plan.prefetch_depth + 1
    out: dict[int, list[Holding]] = {}
    for d, groups in compute_groups(plan).items():
        held: list[Holding] = []
        live: dict[tuple[int, int], Holding] = {}  # (slot, iteration) -> latest holding
        for gi, group in enumerate(groups):
            first = group[0]
            slot, it = plan.slot(first), first.iteration
            key = (slot, first.microbatch, d, it)
            upload = keyed.get((Op.UPLOAD, *key))
            h = live.get((slot, it))
            if h is None or upload is not None or not lowered:
                h = Holding(slot, d, [], [], upload, keyed.get((Op.DOWNLOAD, *key)))
                h.free = keyed.get((Op.FREE, *key))
                held.append(h)
                live[(slot, it)] = h
            h.groups.append(group)
            h.group_indices.append(gi)
        # the gates, once every holding's last group is known (never one a later group keeps
        # alive): in upload order, each takes the holdings ended by then that no earlier took
        by_end = sorted(held, key=lambda h: h.last)
        taken = 0
        for h in held:
            while taken < len(by_end) and by_end[taken].last <= h.first - back:
                h.gates.append(by_end[taken])
                taken += 1
        out[d] = held
    return out


# ---- small text helpers ----------------------------------------------------------------------
_NVME_ROW = "nvme"  # the grid row of the READs (host work, one NVMe lane)


def _row_name(device: int) -> str:
    return "h" if device == HOST else f"d{device}"


def _grid_row(action: Action) -> str:
    """The grid row ``action`` is drawn on (and the text form's issue line names)."""
    return _NVME_ROW if action.op is Op.READ else _row_name(action.device)


def _csv(values: Sequence[int]) -> str:
    return ",".join(str(v) for v in values)


def _parse_csv(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v != "")


def _run_length(names: Iterable[str]) -> list[str]:
    out: list[list] = []
    for name in names:
        if out and out[-1][0] == name:
            out[-1][1] += 1
        else:
            out.append([name, 1])
    return [f"{n}x{c}" if c > 1 else n for n, c in out]


def _run_length_decode(tokens: Sequence[str]) -> list[str]:
    out: list[str] = []
    for tok in tokens:
        name, _, count = tok.partition("x")
        out += [name] * (int(count) if count else 1)
    return out
