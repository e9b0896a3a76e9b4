"""DistributedOptimizer's side of the gradient plan: whether to follow one, and driving its steps.

The first step of a ``DistributedOptimizer`` negotiates every gradient. :class:`PlanDriver`
watches that step's backward pass (did it produce every gradient?) and, after its
``synchronize()``, lets every rank vote on switching to a fixed plan
(``ringmaster.worker.runtime.gradient_plan.GradientPlan``): dense CPU gradients in their own
dtype, no compression, groups or sparsifier. From then on the optimizer's hooks hand each
gradient to the plan (:meth:`PlanDriver.gradient_ready`), and ``step()``/``synchronize()``
finish the step (:meth:`PlanDriver.synchronize`): over the plan's own communicator once it
runs ahead, through a barrier request at the plan's first run. The optimizer keeps Horovod's
API (``optimizer.py``); this module runs on the user's thread, as it does.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ringmaster.worker.frontend import collectives
from ringmaster.worker.frontend.bucket_updates import step_parameters
from ringmaster.worker.frontend.differentiable import allreduce
from ringmaster.worker.frontend.lateness_probes import PROBES
from ringmaster.worker.runtime import current
from ringmaster.worker.runtime.current import runtime
from ringmaster.worker.runtime.errors import RingmasterError
from ringmaster.worker.runtime.gradient_plan import GradientPlan
from ringmaster.worker.runtime.tensors import reduction_dtype


class PlanDriver:
    """One optimizer's gradient plan: None until its first step shows it fits on every rank.

    Args:
        possible: the optimizer's options allow a plan (``RINGMASTER_GRADIENT_PLAN``, no
            compression, groups or sparsifier).
        parameters: the parameters whose gradients are reduced, in the optimizer's order.
        names: their allreduce names.
        delay: the optimizer's backward passes left before each parameter's gradient is final
            (shared: the plan marks filled-in gradients final, and resets it after a step).
        process_set: the set the optimizer averages over.
    """

    def __init__(self, possible: bool, parameters: Sequence[torch.Tensor], names: Dict[torch.Tensor, str],
                 delay: Dict[torch.Tensor, int], process_set):
        self.possible = possible
        self._parameters = list(parameters)
        self._names = names
        self._delay = delay
        self._process_set = process_set
        self.plan: Optional[GradientPlan] = None
        self.step_open = False            # a step of the plan has started (its first hook fired)
        self._filled: set = set()         # parameters the plan reduced as zeros this step
        self._decided = False
        self._runtime = None              # the runtime the plan belongs to
        self._watching_first_pass = False
        self._first_pass_complete = False

    # ------------------------------------------------------------------ state
    def active(self) -> bool:
        """Whether the optimizer's gradients follow the plan now (after a new ``init()``: not yet)."""
        if self.plan is not None and not self.step_open:
            self._forget_plan_of_an_ended_runtime()
        return self.plan is not None

    def runs_ahead(self) -> bool:
        """There is a plan of this runtime, with a communicator of its own (its second step on)."""
        if self.plan is not None:
            self._forget_plan_of_an_ended_runtime()
        return self.plan is not None and self.plan.runs_ahead()

    def filled_in(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s gradient was reduced as zeros this step (backward had ended without it)."""
        return p in self._filled

    def drop_step_of_an_ended_runtime(self) -> bool:
        """Drop a step of the plan begun in a runtime that has ended since (an elastic shrink,
        ``shutdown()``) instead of waiting for it: its communicator is gone, and what restores
        the state (``load_state_dict``) reads ``param_groups`` (gradient_reads.py). True if one
        was dropped: its gradients count for nothing, and the caller resets its pass counts."""
        if not (self.step_open and self._runtime is not None and self._runtime is not current.peek()):
            return False
        self.step_open = False
        self._filled.clear()
        self.plan, self._runtime, self._decided = None, None, False
        return True

    def _forget_plan_of_an_ended_runtime(self) -> None:
        """After ``shutdown()`` and a new ``init()``, negotiate a step again and decide the plan anew.

        The plan's communicator and thread ended with the runtime it was made in.
        """
        if self._runtime is not runtime():
            self.plan = None
            self._runtime = None
            self._decided = False

    # ------------------------------------------------------------------ hooks
    def gradient_ready(self, p: torch.Tensor) -> bool:
        """``p``'s gradient is final for this step: True if the plan took it, else the optimizer negotiates it."""
        if self.active():
            self._hand_over(p)
            return True
        if self.possible and not self._decided and not self._watching_first_pass:
            self._watching_first_pass = True
            torch.autograd.Variable._execution_engine.queue_callback(self._note_first_pass_end)
        return False

    def _note_first_pass_end(self) -> None:
        """End of the first step's communicating backward pass: did it produce every gradient?"""
        self._first_pass_complete = all(self._delay[p] == 0 for p in self._parameters)

    def _hand_over(self, p: torch.Tensor) -> None:
        if not self.step_open:
            self._start_step()
            # Gradients this backward pass does not produce are reduced as zeros when it ends,
            # so that the plan never waits for a step() that waits for the plan.
            torch.autograd.Variable._execution_engine.queue_callback(self._fill_missing)
        if p.grad.is_sparse:
            p.grad = p.grad.to_dense()
        self.plan.mark_ready(self.plan.index[p], p.grad)

    def _start_step(self) -> None:
        """Start this step of the plan; once the plan runs ahead, its thread starts on ready buckets."""
        self.step_open = True
        self.plan.start_step()
        if self.plan.runs_ahead():
            self.plan.run_ahead()

    def _fill_missing(self) -> None:
        """Hand the plan every gradient not handed over yet: the accumulated one, or zeros."""
        if self.plan.all_ready():  # the usual case, once backward has ended
            return
        for p in self._parameters:
            index = self.plan.index[p]
            if self.plan.is_ready(index):
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                p.grad = p.grad.to_dense()
            self._delay[p] = 0
            self._filled.add(p)
            self.plan.mark_ready(index, p.grad)

    # ------------------------------------------------------------------- steps
    def synchronize(self, backward_passes_per_step: int,
                    on_reduced: Optional[Callable[[List[int]], None]] = None) -> None:
        """Finish this step of the plan: every gradient reduced and written into ``p.grad``."""
        try:
            PROBES.plan_step(self.plan.request_name, self._process_set.process_set_id)  # the straggler report
            if not self.step_open:  # no gradient this step: every rank still runs the plan
                self._start_step()
            self._fill_missing()
            if self.plan.runs_ahead():  # no negotiation: the buckets go over the plan's own communicator
                self.plan.finish(lambda: runtime().fatal_error, on_reduced)
            else:  # the plan's first run, on the background thread at its request's place in the order
                collectives.synchronize(collectives.submit_barrier(self.plan.request_name,
                                                                   self._process_set.process_set_id))
        finally:
            self.step_open = False
            self._filled.clear()
            for p in self._parameters:
                self._delay[p] = backward_passes_per_step

    def first_pass_over(self) -> None:
        """A negotiated ``synchronize()`` collected its gradients: the next backward pass is watched anew."""
        self._watching_first_pass = False

    def decide(self, op, scaling: Tuple[float, float]) -> None:
        """After the first negotiated ``synchronize()``: switch to the plan if it fits on every rank
        (one allreduce). ``op``, ``scaling``: the optimizer's op and its (prescale, postscale)."""
        if not self.possible or self._decided:
            return
        self._decided = True
        fits = self._first_pass_complete and all(
            p.grad is not None and not p.grad.is_sparse and p.grad.device.type == "cpu"
            and p.grad.dtype == p.dtype and reduction_dtype(p.dtype) == p.dtype for p in self._parameters)
        order = self._parameters[::-1]  # backward produces the last layers' gradients first
        prescale, postscale = scaling
        if op == collectives.Average:
            postscale /= self._process_set.size()
        plan = GradientPlan(order, [self._names[p] for p in order], prescale, postscale,
                            self._process_set.process_set_id)
        # Sum of ones: a rank that has joined adds zero, and then no plan is used.
        votes = allreduce(torch.tensor([1 if fits else 0], dtype=torch.int32), op=collectives.Sum,
                          name=plan.request_name + ".agree", process_set=self._process_set)
        if int(votes.item()) == self._process_set.size():
            self._runtime = runtime()
            self._runtime.executor.register_plan(self._process_set.process_set_id, plan)
            self.plan = plan

    # ------------------------------------------------------- bucket updates
    def step_bucket(self, step: Callable, param_groups, indices: List[int]) -> None:
        """Apply ``step`` to the parameters of a reduced bucket (``bucket_updates.py``)."""
        parameters = self.plan.parameters
        step_parameters(step, param_groups, [parameters[i] for i in indices])

    def step_outside(self, step: Callable, param_groups) -> None:
        """After the buckets: ``step`` on the parameters the plan does not reduce (a model-parallel shard's)."""
        index = self.plan.index
        rest = [p for group in param_groups for p in group["params"] if p not in index]
        if rest:
            step_parameters(step, param_groups, rest)


def second_pass_error(name: str) -> RingmasterError:
    """A gradient that arrives after the plan reduced it as zeros this step."""
    return RingmasterError(
        f"the gradient of '{name}' arrived from a second backward pass "
        f"after the first one of this step had ended, when it had already been reduced as zeros. "
        f"DistributedOptimizer follows a fixed plan because its first step produced every "
        f"gradient in one backward pass; call step() between backward passes, set "
        f"backward_passes_per_step, or set RINGMASTER_GRADIENT_PLAN=0")
