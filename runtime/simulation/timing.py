"""What each GPU's work costs in one run: its compute model (`compute.Timer` on the GPU profile
its fabric names), the serving stack's factors, and the all-reduce fits; the engine asks it for
nanoseconds and it keeps the per-operator totals the report shows.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .compute import GpuProfile, Stack, Timer
from .figures import figures
from .operators import embedding, lm_head
from .workload import Workload, WorkloadError


@dataclass(frozen=True)
class AllReduce:
    """One all-reduce on one GPU: its fixed cost and the bus bandwidth its ring moves at."""
    alpha_ns: float
    busbw: float            # B/s (0: the links alone)


class Timing:
    def __init__(self, workload: Workload, gpus: list[str], gpu_props: dict[str, dict], stack_name: str):
        self.workload, self.gpus = workload, gpus
        try:
            self.stack = Stack.named(stack_name)
        except KeyError:
            raise WorkloadError(f"unknown serving stack '{stack_name}': stacks are "
                                f"{', '.join(figures()['stacks'])}") from None
        self.timers = {g: self._timer(g, gpu_props.get(g, {})) for g in gpus}
        self.durations: dict[tuple, float] = {}      # (gpu, pass, block) -> ns of its operators
        self._ops: dict[tuple, list] = {}            # (pass, block) -> its operators
        self.operator_ms = defaultdict(float)        # operator -> ms on the first GPU, the whole prefill
        self.beyond_profile_ms = 0.0     # bandwidth time of all-reduces at or beyond the profiled sizes

    def _timer(self, g, props: dict) -> Timer:
        """GPU g's compute model: the profile its `model` property names (the default GPU's
        without one), at its own `bf16` and `hbm_bw` where the fabric gives them."""
        name = profile_of(g, props)
        return Timer(GpuProfile.named(name, props.get("bf16"), props.get("hbm_bw")),
                     self.workload.model, self.workload.tp)

    def block_ns(self, g, p: int, block: str) -> float:
        """ns GPU g computes one layer's block in pass p (the same in every layer); the
        operators of the first GPU's blocks are added to `operator_ms`, per layer."""
        key = (g, p, block)
        if key not in self.durations:
            ops = self.block(p, block)
            times = [self._ns(g, op) for op in ops]
            self.durations[key] = sum(times)
            if g == self.gpus[0]:
                for op, t in zip(ops, times):
                    self.operator_ms[op.name] += t / 1e6 * self.workload.model.layers
        return self.durations[key]

    def _ns(self, g, op) -> float:
        timer = self.timers[g]
        return timer.time(op) * 1e9 * self.stack.kernel(self.stack.figures_of(timer.gpu), op)

    def block(self, p: int, block: str) -> list:
        """The operators of one layer's ``block`` ("attention" or "ffn") in pass p, on one GPU."""
        if (p, block) not in self._ops:
            start, n = self.workload.pass_of(p)
            self._ops.update({(p, name): ops for name, ops in self.workload.blocks(start, n).items()})
        return self._ops[p, block]

    def pass_edges_ns(self, g, p: int, first: bool, last: bool) -> float:
        """The embedding before pass p (``first``) and the LM head after the last pass
        (``last``), on GPU g."""
        w = self.workload
        ops = ([embedding(w.model, w.batch, w.pass_of(p)[1])] if first else []) + \
            ([lm_head(w.model, w.batch, w.tp)] if last else [])
        ns = 0.0
        for op in ops:
            t = self._ns(g, op)
            ns += t
            if g == self.gpus[0]:
                self.operator_ms[op.name] += t / 1e6
        return ns

    def all_reduce(self, g, nbytes: int) -> AllReduce:
        """An all-reduce of ``nbytes`` over the group from GPU g: the fit for the group's TP
        degree (or the nearest fitted one) of g's profile, with the stack's share of the bus
        bandwidth for that degree where the size is at or beyond the largest profiled one (the first GPU's such
        all-reduces add their time at the profiled bandwidth to `beyond_profile_ms`)."""
        t = len(self.gpus)
        fits = self.timers[g].gpu.coeffs.get("all_reduce")
        if not fits:
            return AllReduce(0.0, 0.0)
        fitted = min(fits, key=lambda k: abs(int(k) - t))
        fit, busbw = fits[fitted], float(fits[fitted]["busbw"])
        if nbytes < fit["max_size"]:
            return AllReduce(float(fit["alpha"]), busbw)
        if g == self.gpus[0]:
            self.beyond_profile_ms += 2 * (t - 1) * nbytes // t / busbw * 1e3
        return AllReduce(float(fit["alpha"]), busbw * self.stack.busbw(int(fitted)))

    def pass_floor_ns(self) -> float:
        """The least time a pass takes in this stack, on the first GPU's machine."""
        return self.stack.floor(self.stack.figures_of(self.timers[self.gpus[0]].gpu)) * 1e6

    def pass_cpu_ns(self) -> float:
        """The stack's CPU work at the end of a pass, for every prompt of the batch."""
        return self.stack.per_prompt_ms * self.workload.batch * 1e6


def profile_of(g: str, props: dict) -> str:
    """The GPU profile (figures.json "gpu") GPU g's `model` property names, else the default."""
    name = props.get("model") or figures()["defaults"]["gpu"]
    if name not in figures()["gpu"]:
        raise WorkloadError(f"GPU {g}: unknown model '{name}'; GPU profiles: {', '.join(figures()['gpu'])}")
    return name
