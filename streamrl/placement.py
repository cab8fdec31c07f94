"""Roles and placement: which process of a run uses which device on which node.

The Hybrid model of HybridFlow/verl: a run declares its roles once — ``learner`` (the
actor), ``rollout``, and optionally ``reference``, ``reward`` (a reward model) and
``critic`` — and places each on devices. Roles may share a GPU only when a
``placement.colocate`` group says so; learner ranks never share one (NCCL wants one GPU per
rank). The learner job and the rollout workers are the two main processes; ``reference``,
``reward`` and ``critic``, when placed, also run as role servers of their own
(:mod:`streamrl.roles.launch`), and are counted here with the process they serve (reference
and critic with the learner, reward with the rollout workers) for the GPU-sharing rules. A
process sees exactly the GPUs of its roles through ``CUDA_VISIBLE_DEVICES``, so devices inside
it are renumbered from 0.

Device strings: ``cpu``; ``cuda`` (every GPU of the host); ``cuda:N``; ``cuda:N-M``; any of
them node-qualified, ``node1:cuda:0`` or ``node0-1:cuda:0-3`` (node = ``--node-rank``).
Unqualified devices live on the node that runs the role: learner ranks on node 0, rollout
workers on every host started with ``--role rollout`` or ``--role all``.

Examples:
    >>> from streamrl.config import PlacementConfig
    >>> plan = plan_node(PlacementConfig(learner=["cuda:0", "cuda:1"], rollout=["cuda:2"]),
    ...                  learners=None, rollers=2, gpu_count=4)
    >>> plan.learner.env["CUDA_VISIBLE_DEVICES"], [r.env["CUDA_VISIBLE_DEVICES"] for r in plan.rollouts]
    ('0,1', ['2', '2'])
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from streamrl.errors import ConfigError

ROLES = ("learner", "rollout", "reference", "reward", "critic")
ALIASES = {"actor": "learner", "ref": "reference", "reward_model": "reward", "rm": "reward"}
# Which main process a role belongs to (its GPUs count as that process's for colocation).
HOST = {"learner": "learner", "reference": "learner", "critic": "learner", "rollout": "rollout", "reward": "rollout"}
LAUNCH_ROLES = ("all", "learner", "rollout")

_DEVICE = re.compile(r"^(?:node(\d+)(?:-(\d+))?:)?(cpu|cuda)(?::(\d+)(?:-(\d+))?)?$")


class PlacementError(ConfigError):
    """A placement cannot be satisfied or is malformed; the one-line message names the problem."""


@dataclass(frozen=True)
class Device:
    """One device: ``kind`` 'cpu'/'cuda', GPU ``index`` (None: cpu, or bare 'cuda' = all GPUs), ``node`` rank or None."""

    kind: str
    index: int | None = None
    node: int | None = None

    def local(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"

    def __str__(self) -> str:
        return self.local() if self.node is None else f"node{self.node}:{self.local()}"


def canonical_role(name: str, where: str) -> str:
    """``actor`` -> ``learner`` etc.; unknown names raise naming the known roles."""
    role = ALIASES.get(str(name).strip().lower(), str(name).strip().lower())
    if role not in ROLES:
        raise PlacementError(f"{where}: unknown role {name!r}; roles: learner (actor), rollout, reference, "
                             f"reward, critic")
    return role


def parse_devices(spec: Any, where: str) -> list[Device]:
    """Parse a device string or list of them (ranges expanded); ``None`` -> []."""
    if spec is None:
        return []
    items = [spec] if isinstance(spec, str) else spec
    if not isinstance(items, list) or not items:
        raise PlacementError(f"{where} = {spec!r}: expected a device string or a non-empty list of them")
    out: list[Device] = []
    for item in items:
        m = _DEVICE.match(item.strip()) if isinstance(item, str) else None
        if m is None or (m.group(3) == "cpu" and m.group(4) is not None):
            raise PlacementError(f"{where}: bad device string {item!r}; expected cpu, cuda, cuda:N or cuda:N-M, "
                                 f"optionally prefixed nodeK: (e.g. node1:cuda:0)")
        n0, n1, kind, i0, i1 = m.groups()
        nodes = _span(n0, n1, item, where)
        idxs = _span(i0, i1, item, where)
        out += [Device(kind, i, n) for n in nodes for i in idxs]
    if len({d.node is None for d in out}) > 1:
        raise PlacementError(f"{where} = {spec!r}: mixes node-qualified and plain devices; qualify all or none")
    return out


def _span(lo: str | None, hi: str | None, item: str, where: str) -> list[int | None]:
    if lo is None:
        return [None]
    a, b = int(lo), int(hi) if hi is not None else int(lo)
    if b < a:
        raise PlacementError(f"{where}: bad range in {item!r}; the end must be >= the start")
    return list(range(a, b + 1))


def validate_placement_config(pc, p: str) -> None:
    """Static checks of a ``PlacementConfig`` (syntax, roles, learner rules); machine checks are in :func:`plan_node`."""
    for role in ROLES:
        parse_devices(getattr(pc, role), f"{p}.{role}")
    _learner_rules(parse_devices(pc.learner, f"{p}.learner"), f"{p}.learner")
    _colocate_groups(pc.colocate, f"{p}.colocate")


def _learner_rules(devs: list[Device], where: str) -> None:
    if len({d.kind for d in devs}) > 1:
        raise PlacementError(f"{where} mixes cpu and cuda devices; all learner ranks must use one kind")
    if any(d.kind == "cuda" and d.index is None for d in devs) and len(devs) > 1:
        raise PlacementError(f"{where}: bare 'cuda' (every GPU) must be the only learner entry; name GPUs as cuda:N")
    seen: set[tuple] = set()
    for d in devs:
        if d.kind == "cuda" and d.index is not None:
            if (d.node, d.index) in seen:
                raise PlacementError(f"{where}: {d} is listed twice; learner ranks need one GPU each (NCCL)")
            seen.add((d.node, d.index))


def _colocate_groups(groups: Any, where: str) -> list[set[str]]:
    if not isinstance(groups, list):
        raise PlacementError(f"{where} = {groups!r}: expected a list of role groups, e.g. [[learner, reference]]")
    out = []
    for g in groups:
        if isinstance(g, str):
            g = [x for x in re.split(r"[+,\s]+", g) if x]
        if not isinstance(g, list) or len(g) < 2:
            raise PlacementError(f"{where}: group {g!r} must list at least two roles")
        out.append({canonical_role(r, where) for r in g})
    return out


@dataclass
class ProcessPlacement:
    """Devices and environment of one process: the learner job on this node or one rollout worker."""

    name: str
    role: str
    devices: list[Device]
    """learner: one device per local rank; rollout: the worker's one device."""
    device_arg: str
    """Device name inside the process after CUDA_VISIBLE_DEVICES renumbering ('cpu', 'cuda', 'cuda:0')."""
    env: dict[str, str] = field(default_factory=dict)
    hosted: dict[str, list[Device]] = field(default_factory=dict)
    """Optional roles this process hosts (reference/critic in the learner, reward in rollout workers)."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "role": self.role, "devices": [str(d) for d in self.devices],
                "device_arg": self.device_arg, "env": dict(self.env),
                "hosted": {k: [str(d) for d in v] for k, v in self.hosted.items()}}


@dataclass
class NodePlan:
    """What one host starts: its part of the learner job and its rollout workers."""

    node_rank: int
    nnodes: int
    role: str
    learner_world: int
    learner_nodes: list[int]
    learner: ProcessPlacement | None
    rollouts: list[ProcessPlacement]

    @property
    def learner_nnodes(self) -> int:
        return len(self.learner_nodes)

    @property
    def learner_node_rank(self) -> int:
        return self.learner_nodes.index(self.node_rank)

    def to_dict(self) -> dict[str, Any]:
        return {"node_rank": self.node_rank, "nnodes": self.nnodes, "role": self.role,
                "learner_world": self.learner_world, "learner_nodes": self.learner_nodes,
                "learner": self.learner.to_dict() if self.learner else None,
                "rollouts": [r.to_dict() for r in self.rollouts]}


def uses_cuda(pc, learner_device: str = "cpu", rollout_device: str = "cpu") -> bool:
    """Whether any role could need a GPU (so the launcher must ask torch how many exist)."""
    specs = [pc.learner or learner_device, pc.rollout or rollout_device, pc.reference, pc.reward, pc.critic]
    return any("cuda" in str(s) for s in specs if s is not None)


def plan_node(pc, *, learners: int | None, rollers: int | None, learner_device: str = "cpu",
              rollout_device: str = "cpu", nnodes: int = 1, node_rank: int = 0, role: str = "all",
              gpu_count: int = 0, visible: list[str] | None = None) -> NodePlan:
    """Resolve ``pc`` (a PlacementConfig) for the host ``node_rank`` of ``nnodes`` running ``role``.

    ``gpu_count`` is this host's ``torch.cuda.device_count()``; ``visible`` the launcher's own
    ``CUDA_VISIBLE_DEVICES`` list (None = GPUs 0..gpu_count-1), so children get physical ids.
    Raises :class:`PlacementError` with a one-line message naming the problem.
    """
    _check_launch_args(role, nnodes, node_rank, learners, rollers)
    groups = _colocate_groups(pc.colocate, "placement.colocate")
    lwhere = "placement.learner" if pc.learner is not None else "learner.device"
    rwhere = "placement.rollout" if pc.rollout is not None else "rollout.device"
    ldevs = parse_devices(pc.learner if pc.learner is not None else learner_device, lwhere)
    rdevs = parse_devices(pc.rollout if pc.rollout is not None else rollout_device, rwhere)
    optional = {r: parse_devices(getattr(pc, r), f"placement.{r}") for r in ("reference", "reward", "critic")}
    for where, devs in [(lwhere, ldevs), (rwhere, rdevs)] + [(f"placement.{r}", d) for r, d in optional.items()]:
        for d in devs:
            if d.node is not None and d.node >= nnodes:
                raise PlacementError(f"{where}: {d} names node {d.node}, but --nnodes is {nnodes}")
    _learner_rules(ldevs, lwhere)
    gpus = _GpuCheck(gpu_count)
    # learner ranks are global (one device each); each node then takes its own share
    ldevs = _expand_learner(ldevs, learners, lwhere, gpu_count if node_rank == 0 else None)
    learner_nodes = sorted({d.node for d in ldevs})
    runs_learner = role in ("all", "learner") and node_rank in learner_nodes
    if role == "learner" and not runs_learner:
        raise PlacementError(f"--role learner on node {node_rank}, but {lwhere} puts learner ranks on "
                             f"node(s) {learner_nodes} only")
    learner = None
    if runs_learner:
        learner = _learner_process(ldevs, lwhere, optional, node_rank, learner_nodes, gpus, visible)
    rollouts: list[ProcessPlacement] = []
    if role in ("all", "rollout"):
        rollouts = _rollout_processes(rdevs, rwhere, optional["reward"], role, node_rank, rollers, gpus, visible)
    _check_colocation(learner, rollouts, groups, node_rank)
    return NodePlan(node_rank, nnodes, role, len(ldevs), learner_nodes, learner, rollouts)


def _check_launch_args(role: str, nnodes: int, node_rank: int, learners: int | None, rollers: int | None) -> None:
    """The launcher flags on their own: --role, --nnodes/--node-rank, --learners/--rollers."""
    if role not in LAUNCH_ROLES:
        raise PlacementError(f"--role {role!r}: expected one of {', '.join(LAUNCH_ROLES)}")
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise PlacementError(f"--node-rank {node_rank} with --nnodes {nnodes}: need 0 <= node-rank < nnodes")
    for flag, v in (("--learners", learners), ("--rollers", rollers)):
        if v is not None and v < (1 if flag == "--learners" else 0):
            raise PlacementError(f"{flag} = {v}: must be >= {1 if flag == '--learners' else 0}")


def _learner_process(ldevs: list[Device], lwhere: str, optional: dict[str, list[Device]], node_rank: int,
                     learner_nodes: list[int], gpus: _GpuCheck, visible: list[str] | None) -> ProcessPlacement:
    """This node's part of the learner job: its ranks' devices and the reference/critic it hosts."""
    local = [d for d in ldevs if d.node == node_rank]
    for d in local:
        gpus.check(d, lwhere)
    hosted = {}
    for r in ("reference", "critic"):
        hosted_here = _hosted_here(optional[r], f"placement.{r}", node_rank, learner_nodes, "learner", gpus)
        if hosted_here:
            hosted[r] = hosted_here
    return _process("learner", "learner", local, hosted, visible, per_rank=True)


def _rollout_processes(rdevs: list[Device], rwhere: str, reward_devs: list[Device], role: str, node_rank: int,
                       rollers: int | None, gpus: _GpuCheck, visible: list[str] | None) -> list[ProcessPlacement]:
    """This node's rollout workers, dealt round-robin over its rollout devices (``--rollers`` of
    them, default one per device), each hosting the node's reward-model devices."""
    explicit = [d for d in rdevs if d.node in (None, node_rank)]
    local = []
    for d in explicit:
        if d.kind == "cuda" and d.index is None:
            if gpus.count == 0:
                raise PlacementError(f"{rwhere} = 'cuda' but this host has no GPU (torch.cuda.device_count() = 0)")
            local += [Device("cuda", i, node_rank) for i in range(gpus.count)]
        else:
            local.append(Device(d.kind, d.index, node_rank))
    if not local and (role == "rollout" or rollers):
        raise PlacementError(f"--role {role} on node {node_rank}, but {rwhere} places no rollout device on "
                             f"node {node_rank}")
    m = len(local) if rollers is None else rollers
    bare = any(d.kind == "cuda" and d.index is None for d in explicit)
    if local and m < len(local) and not bare:
        raise PlacementError(f"--rollers {m} but {rwhere} lists {len(local)} devices on this node "
                             f"({', '.join(d.local() for d in local)}); some would stay unused")
    if role == "rollout" and m < 1:
        raise PlacementError(f"--rollers {m} with --role rollout: this host would start nothing")
    for d in local:
        gpus.check(d, rwhere)
    reward = _hosted_here(reward_devs, "placement.reward", node_rank, None, "rollout", gpus)
    return [_process(f"rollout-{i}", "rollout", [local[i % len(local)]], {"reward": reward} if reward else {},
                     visible, per_rank=False) for i in range(m)]


class _GpuCheck:
    def __init__(self, count: int):
        self.count = count

    def check(self, d: Device, where: str) -> None:
        if d.kind == "cuda" and d.index is not None and d.index >= self.count:
            raise PlacementError(f"{where}: {d.local()} needs {d.index + 1} GPU(s), but this host has {self.count} "
                                 f"(torch.cuda.device_count())")


def _expand_learner(devs: list[Device], learners: int | None, where: str, gpu_count: int | None) -> list[Device]:
    """One device per learner rank, every device node-qualified (plain devices live on node 0)."""
    if len(devs) == 1 and devs[0].index is None:
        d = devs[0]
        node = d.node if d.node is not None else 0
        if d.kind == "cpu":
            return [Device("cpu", None, node)] * (learners or 1)
        if gpu_count is not None and gpu_count == 0:
            raise PlacementError(f"{where} = 'cuda' but this host has no GPU (torch.cuda.device_count() = 0)")
        n = learners or gpu_count or 1
        if gpu_count is not None and n > gpu_count:
            raise PlacementError(f"--learners {n} with {where} = 'cuda' needs {n} GPUs, but this host has {gpu_count}")
        return [Device("cuda", i, node) for i in range(n)]
    if learners is not None and learners != len(devs):
        raise PlacementError(f"--learners {learners} but {where} lists {len(devs)} device(s) "
                             f"({', '.join(map(str, devs))}); give one device per rank")
    return [d if d.node is not None else Device(d.kind, d.index, 0) for d in devs]


def _hosted_here(devs: list[Device], where: str, node_rank: int, host_nodes: list[int] | None, host: str,
                 gpus: _GpuCheck) -> list[Device]:
    if any(d.kind == "cuda" and d.index is None for d in devs):
        raise PlacementError(f"{where}: bare 'cuda' is ambiguous for an optional role; name GPUs as cuda:N")
    if host_nodes is not None:
        for d in devs:
            if d.node is not None and d.node not in host_nodes:
                raise PlacementError(f"{where}: {d} is on node {d.node}, but its host process ({host}) runs on "
                                     f"node(s) {host_nodes}")
    here = [Device(d.kind, d.index, node_rank) for d in devs if d.node in (None, node_rank)]
    for d in here:
        gpus.check(d, where)
    return here


def _process(name: str, role: str, devices: list[Device], hosted: dict[str, list[Device]],
             visible: list[str] | None, per_rank: bool) -> ProcessPlacement:
    """Build CUDA_VISIBLE_DEVICES (the process's GPUs first, hosted roles' after) and device names."""
    order: list[int] = []
    for d in devices + [d for ds in hosted.values() for d in ds]:
        if d.kind == "cuda" and d.index not in order:
            order.append(d.index)
    phys = [visible[i] if visible is not None else str(i) for i in order]
    env = {"CUDA_VISIBLE_DEVICES": ",".join(phys)}  # "" hides every GPU from a CPU process

    def renamed(d: Device) -> str:
        return "cpu" if d.kind == "cpu" else f"cuda:{order.index(d.index)}"

    main_kind = devices[0].kind
    if role == "learner":
        device_arg = main_kind  # ranks take cuda:LOCAL_RANK
        if main_kind == "cpu":
            env["STREAMRL_BACKEND"] = "gloo"
    else:
        device_arg = renamed(devices[0])
    for r, ds in hosted.items():
        env[f"STREAMRL_DEVICE_{r.upper()}"] = ",".join(renamed(d) for d in ds)
    return ProcessPlacement(name, role, devices, device_arg, env, hosted)


def _check_colocation(learner: ProcessPlacement | None, rollouts: list[ProcessPlacement],
                      groups: list[set[str]], node_rank: int) -> None:
    users: dict[int, set[str]] = {}
    for proc in ([learner] if learner else []) + rollouts:
        for role, ds in [(proc.role, proc.devices), *proc.hosted.items()]:
            for d in ds:
                if d.kind == "cuda":
                    users.setdefault(d.index, set()).add(role)
    for idx, roles in sorted(users.items()):
        rs = sorted(roles, key=ROLES.index)
        for i, a in enumerate(rs):
            for b in rs[i + 1:]:
                if not any({a, b} <= g for g in groups):
                    raise PlacementError(f"placement: cuda:{idx} on node {node_rank} is used by {a} and {b}, which are "
                                         f"not colocated; give them separate GPUs or add [{a}, {b}] to "
                                         f"placement.colocate")


def assign_threads(plan: NodePlan, cores: int, learner_threads: int = 0, rollout_threads: int = 0) -> dict[str, int]:
    """Size each local process's intra-op threads (``STREAMRL_THREADS``, ``OMP_NUM_THREADS``).

    Auto (0) rules, from what the loop does with the cores of one host:

    * a rollout worker gets its fair share, ``cores // (local learner ranks + workers)``;
    * a learner rank gets the cores the workers do not, ``(cores - workers' threads) // local
      learner ranks``: threads that add up to more than the cores make every small op of the
      learner wait for a descheduled thread. Measured on 2 cores, SmolLM2-135M 2 x 8 shared step
      beside others' load, one process alternating: 2 threads 38.2 s wall / 30.2 s CPU, 1 thread
      17.8 s / 8.8 s; the real loop (1 learner + 1 worker) ran 2.48 samples/s with a 2-thread
      learner and 2.64 with 1;
    * never fewer than 1. When the threads still add up to more than ``cores`` (more processes
      than cores, or fixed counts) the processes are told to sleep rather than spin while
      waiting for work (``OMP_WAIT_POLICY=PASSIVE``), so a blocked process's thread pool does
      not burn the cores another one needs.
    * a CPU learner is told how many threads this host's CPU workers hold
      (``STREAMRL_LENDABLE_THREADS``): with ``placement.lend_idle_cores`` it borrows them while
      those workers wait (:mod:`streamrl.core_lending`), and never more;
    * the other way round, each CPU worker beside a CPU learner is told its share of the
      learner's threads (``STREAMRL_BORROWABLE_THREADS``: the learner ranks' threads split over
      the host's CPU workers, rounded down): it decodes with them while the learner waits for
      data (:mod:`streamrl.core_lending`).

    Args:
        plan: this host's plan; each process's ``env`` is updated in place.
        cores: CPU cores this host may use (``len(os.sched_getaffinity(0))``).
        learner_threads, rollout_threads: fixed counts (``placement.learner_threads`` /
            ``placement.rollout_threads``); 0 = the auto rule above.

    Returns:
        ``{process name: threads}``.

    Examples:
        >>> from streamrl.config import PlacementConfig
        >>> plan = plan_node(PlacementConfig(), learners=1, rollers=1)
        >>> assign_threads(plan, cores=2)
        {'learner': 1, 'rollout-0': 1}
        >>> crowded = plan_node(PlacementConfig(), learners=1, rollers=3)
        >>> assign_threads(crowded, cores=2)
        {'learner': 1, 'rollout-0': 1, 'rollout-1': 1, 'rollout-2': 1}
        >>> crowded.learner.env["OMP_WAIT_POLICY"], crowded.learner.env["STREAMRL_LENDABLE_THREADS"]
        ('PASSIVE', '3')
        >>> plan.rollouts[0].env["STREAMRL_BORROWABLE_THREADS"], crowded.rollouts[0].env["STREAMRL_BORROWABLE_THREADS"]
        ('1', '0')
    """
    sizes = _thread_sizes(plan, cores, learner_threads, rollout_threads)
    ranks = len(plan.learner.devices) if plan.learner is not None else 0
    total = sizes.get(plan.learner.name, 0) * ranks if plan.learner is not None else 0
    total += sum(sizes[r.name] for r in plan.rollouts)
    for p in ([plan.learner] if plan.learner is not None else []) + plan.rollouts:
        p.env["STREAMRL_THREADS"] = p.env["OMP_NUM_THREADS"] = str(sizes[p.name])
        if total > cores:
            p.env["OMP_WAIT_POLICY"] = "PASSIVE"
    if plan.learner is not None and plan.learner.devices[0].kind == "cpu":
        _lending_env(plan, sizes)
    return sizes


def _thread_sizes(plan: NodePlan, cores: int, learner_threads: int, rollout_threads: int) -> dict[str, int]:
    """``{process name: threads}`` by the rules of :func:`assign_threads` (learner first)."""
    ranks = len(plan.learner.devices) if plan.learner is not None else 0
    procs = ranks + len(plan.rollouts)
    sizes = {r.name: rollout_threads or max(1, cores // max(procs, 1)) for r in plan.rollouts}
    if plan.learner is not None:
        left = cores - sum(sizes.values())
        sizes = {plan.learner.name: learner_threads or max(1, left // ranks), **sizes}
    return sizes


def _lending_env(plan: NodePlan, sizes: dict[str, int]) -> None:
    """Tell a CPU learner and this host's CPU workers how many of each other's threads they may borrow."""
    ranks = len(plan.learner.devices)
    cpu_workers = [r for r in plan.rollouts if r.devices[0].kind == "cpu"]
    # what the learner may borrow while these workers wait (streamrl.core_lending)
    plan.learner.env["STREAMRL_LENDABLE_THREADS"] = str(sum(sizes[r.name] for r in cpu_workers))
    # and what each CPU worker may borrow while the learner waits (streamrl.core_lending)
    for r in cpu_workers:
        r.env["STREAMRL_BORROWABLE_THREADS"] = str(sizes[plan.learner.name] * ranks // len(cpu_workers))
