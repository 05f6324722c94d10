"""DeepSpeed's imperative loop over RoundPipe: ``loss = engine(batch); engine.backward(loss);
engine.step()``, with the accumulation window run as ONE schedule, as ``train_batch`` runs it.

Running each ``engine(batch)`` and each ``backward`` as its own run would upload every weight per
micro-batch and per pass: ZeRO-3's traffic. Instead (window.py has the states)::

    engine(b0)      queue b0, return a deferred loss L0 (deferred.py)
    backward(L0)    factor f0 = d(caller's loss)/d(L0), from the recorded arithmetic
    step()          not a boundary: counters only
    ...
    backward(L3)    the boundary: the window runs now, b0..b3 in one schedule: one weight
                    upload per slot, the head's d(loss) of micro-batch m scaled by f_m
                    (train_batch's run, with iterations overlapping); L0..L3 get their values
    step()          the boundary applied (in flight when the run is, as train_batch does)

- Reading a loss before its window ran (``loss.item()``, ``print``), before or after its
  backward, runs that micro-batch's forward alone, now, so a value is never a placeholder; its
  backward stays queued, and the boundary runs the resumed micro-batches' backwards and the
  unread micro-batches whole in ONE schedule (window.py). A caller's loss not affine in ours
  (``loss ** 2``) does the same. A loop that reads every loss thus costs one forward pass per
  micro-batch more than ``train_batch``, never a backward pass. The loader ``initialize``
  returns (``training_data=``) announces each window ahead (``expect_micro_batches``), so there
  reads cost nothing at all.
- ``managed_gradient_accumulation: false`` (DeepSpeed 0.19.8): every ``step()`` closes the
  window, whatever its length; ``backward`` never does.
- A module model whose forward returns outputs runs its forward at once (the caller's criterion
  needs them) and queues its backward: the window's backwards run as one schedule.
- A failure inside the window raises from the call that ran it (the boundary's ``backward``,
  ``step()`` or a read), drops the step's gradients (the weights are untouched), and the step
  counts as skipped at its ``step()``; the window's unread losses raise when read.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from rp_engine.engine.deferred import DeferredValue, Leaf, derivative
from rp_engine.engine.fused_lm_head import fused_output
from rp_engine.engine.pipeline import BACKWARD_OPS, FORWARD_OPS
from rp_engine.engine.prefetch import FactorModel, Prefetch, ReadyGate
from rp_engine.engine.window import Entry, Window
from rp_engine.model.base import writable
from rp_engine.model.module import rebuild_outputs
from rp_engine.runtime.run_state import Resume

if TYPE_CHECKING:
    from rp_engine.engine.pipeline import Pipeline
    from rp_engine.model.batches import BatchAdapter
    from rp_engine.optim.nonfinite import NonFiniteGuard
    from rp_engine.optim.optimizer import HostOptimizer
    from rp_engine.optim.stepper import OptimizerStepper
    from rp_engine.runtime.counters import StepCounters
    from rp_engine.runtime.executor import RunResult
    from rp_engine.runtime.planning import Planner

__all__ = ["WindowRunner", "LoopMisuseError", "FORWARD_OPS", "BACKWARD_OPS"]

log = logging.getLogger("rp_engine")


class WindowRunner:
    """The imperative loop's accumulation window (``engine.loop``): ``forward`` / ``backward`` /
    ``step`` of ``deepspeed.DeepSpeedEngine`` (the engine checks for an optimizer and
    ``no_sync()`` first, and times them). It owns the open window, the prefetched window and
    the gate that holds a prefetched run's gradients from the optimizer; it runs the window's
    work on the pipeline and applies the boundary through it (never the reverse: the pipeline
    reaches it only through the hooks it is given, ``on_abort`` and a provisional run's)."""

    def __init__(
        self,
        *,
        pipeline: Pipeline,
        planner: Planner,
        stepper: OptimizerStepper,
        optimizer: HostOptimizer,
        counters: StepCounters,
        guard: NonFiniteGuard,
        batches: BatchAdapter,
        batch_of: Callable[..., dict[str, Any]],
        module: torch.nn.Module,
        device: torch.device,
        gate: ReadyGate,
        gas: int,
        managed: bool,
        overlap: bool,
    ) -> None:
        self.pipeline = pipeline
        self.planner = planner
        self.stepper = stepper
        self.host_optimizer = optimizer
        self.counters = counters
        self.guard = guard
        self.batches = batches
        # the engine's: a micro-batch's state (its first also completes the memory rule)
        self.batch_of = batch_of
        self.module = module  # its training flag and grad mode pick training or eval forwards
        self.device = device  # where the losses the caller gets live
        self.gate = gate  # between the executor and the optimizer (the engine's executors)
        self.gas = gas
        self.managed = managed  # DeepSpeed's managed_gradient_accumulation
        self.overlap = overlap  # whether the window's run may stay in flight (core.py)
        self.window = Window()  # the open accumulation window
        self.prefetch: Prefetch | None = None  # an announced window (expect_micro_batches)
        self.factor_model = FactorModel()  # a prefetched window's predicted factors
        # the last forward ran in eval mode with grad enabled: (batch, share, loss leaf) for
        # backward
        self._eval_forward: tuple[dict[str, Any], float, torch.Tensor] | None = None

    # --- forward --------------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """One micro-batch's forward; returns the loss (a Hugging Face ``CausalLMOutput`` for
        HF models, else the loss tensor). In training mode the loss is deferred: its window
        runs as one schedule later (module docstring); reading it runs what it waits for.

        ``fused_lm_head=True`` (TRL's fused LM head) returns TRL's ``FusedCausalLMOutput``
        instead: per-token log-probs, entropy, top-1 hits, label mask (fused_lm_head.py). TRL
        reads them at once: from a prefetched window's run (``expect_micro_batches``, which
        Trainer's patch calls), else that micro-batch runs alone, now."""
        self.stepper.check()
        if self.batches.seq.returns_outputs:
            return self._forward_outputs(inputs, kwargs)
        # Transformers' Trainer passes the token count of the whole optimizer step; the model
        # then returns sum / count instead of the micro-batch mean (as HF's ForCausalLMLoss).
        num_items = kwargs.pop("num_items_in_batch", None)
        fused = _fused_request(kwargs.pop("fused_lm_head", False), self.batches.seq.head)
        batch = self.batch_of(inputs, kwargs)
        share = self.batches.token_share(batch, num_items)
        if not (self.module.training and torch.is_grad_enabled()):
            result = self.pipeline.eval_run([batch], token_stats=fused)
            value = torch.tensor(result.losses[0], device=self.device)
            if fused:
                return fused_output(value * share, result.token_stats[0], leaf=None)
            return self.batches.wrap_loss(self._eval_loss(batch, share, value))
        self._before_new_entry()
        known = self._from_prefetch(batch, num_items, fused)
        if known is not None:
            return known
        entry = self.window.add(Entry(batch, share, self._next_microbatch(), fused=fused))
        if fused:  # TRL reads the per-token statistics at once: this micro-batch runs now
            result = self._run_forward(entry)
            leaf = torch.tensor(result.losses[0], device=self.device, requires_grad=True)
            entry.real_leaf = leaf  # TRL's log-probs tie their gradient to it (fused_lm_head.py)
            return fused_output(leaf * share, entry.stats, leaf=leaf)
        entry.leaf = Leaf(_resolver(self, entry), _placeholder(self.device))
        # the caller's loss is what the model returns: the head's mean times the token share
        return self.batches.wrap_loss(DeferredValue(entry.leaf, entry.leaf.placeholder) * share)

    def _eval_loss(self, batch: dict[str, Any], share: float, value: torch.Tensor) -> Any:
        """An eval-mode forward's loss. With grad enabled DeepSpeed runs autograd whatever the
        module's mode, so a backward of it trains with the module's mode (dropout off): the loss
        is then a leaf the caller's graph reaches, and its backward adds the micro-batch to the
        window (:meth:`_adopt_eval_forward`), whose schedule runs it again, with gradients."""
        self._eval_forward = None
        if not torch.is_grad_enabled() or self.host_optimizer.empty:
            return value * share
        self._eval_forward = (batch, share, value.requires_grad_(True))
        return value * share

    def _adopt_eval_forward(self) -> Entry | None:
        """backward() after an eval-mode forward with grad enabled: that micro-batch joins the
        window as an entry whose value is known (as a prefetched one's), ready at its backward."""
        if self._eval_forward is None:
            return None
        batch, share, leaf = self._eval_forward
        self._before_new_entry()  # (clears _eval_forward)
        self._cancel_prefetch()  # a prefetched window's factors do not cover this micro-batch
        entry = self.window.add(Entry(batch, share, self._next_microbatch()))
        entry.real_leaf = leaf
        return entry

    def _forward_outputs(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A module model's forward: its own return value, rebuilt from the head's outputs
        (training: floating tensors on the engine's device that collect the caller's
        gradient for ``backward``). Runs now: the caller's criterion needs the outputs."""
        batch = self.batch_of(inputs, kwargs)
        if not (self.module.training and torch.is_grad_enabled()):
            outputs = self.pipeline.eval_run([batch]).outputs[0]
            return rebuild_outputs(outputs, lambda _k, v: _to(v, self.device))
        self._before_new_entry()
        entry = self.window.add(Entry(batch, 1.0, self._next_microbatch()))
        result = self._run_forward(entry)
        leaves: dict[str, torch.Tensor] = {}

        def leaf(key: str, value: Any) -> Any:
            value = _to(value, self.device)
            if key.startswith("hidden."):  # a floating output: it may carry the loss's gradient
                value = leaves[key] = value.detach().requires_grad_(True)
                return writable(value)  # not the leaf: the caller may scale it in place
            return value

        out = rebuild_outputs(result.outputs[0], leaf)
        entry.output_leaves = leaves
        return out

    def _next_microbatch(self) -> int:
        """The engine-wide number of the next entry (its dropout seeds): the window's first
        entry's ``micro_steps``, then one more per entry. DeepSpeed's loop calls step() after
        every micro-batch, so that is ``micro_steps`` itself, as train_batch numbers them;
        Accelerate calls it once per window, and the window's micro-batches still differ."""
        first = (
            self.window.entries[0].micro_step if self.window.entries else self.counters.micro_steps
        )
        return first + len(self.window.entries)

    def _run_forward(self, entry: Entry) -> Any:
        """The forward stages and the head of one entry, alone (a forward run): its carry
        waits for its backward on the device (a module model's: host tensors only)."""
        try:
            result = self.pipeline.run(
                self.planner.plan(1, ops=FORWARD_OPS), [entry.batch],
                step=self.counters.global_steps + 1, defer_head=True, closes_step=False,
                token_stats=entry.fused, microbatch_offset=entry.micro_step,
                keep_weights=self.planner.keeps_forward_weights(),  # for the window's next read
                head_loss_only=self._head_reruns(),
            )  # fmt: skip
        except BaseException as exc:
            self.window_lost(exc)
            raise
        self.window.runs += 1  # its head's gradients may be kept, but they are this step's
        entry.carry = result.carry
        if result.token_stats:
            entry.stats = result.token_stats[0]
        return result

    def _head_reruns(self) -> bool:
        """Whether a read's forward run computes the head's loss only, leaving the head's
        backward to the window's run (the head stage holds blocks whose backward would run in
        the read, alone); a module model's head gives the caller its outputs instead."""
        return not self.batches.seq.returns_outputs

    def _forward_alone(self, entry: Entry) -> None:
        """Run the entry's forward now (its value is read, or its caller's loss needs its value
        for the derivative); its backward is queued for the window's run (``_queue_backward``,
        at once when its backward was called already)."""
        result = self._run_forward(entry)
        assert entry.leaf is not None
        entry.leaf.set(torch.tensor(result.losses[0], device=self.device))
        if entry.factor is not None:
            self._queue_backward(entry)

    def _queue_backward(self, entry: Entry) -> None:
        """An entry whose forward ran alone, its factor known: its backward waits for the
        window's run, resumed from its carry (the loss scale is applied there, ``_scaled``)."""
        assert entry.carry is not None and entry.factor is not None
        entry.resume = Resume(entry.carry, entry.factor)
        entry.carry = None

    def _before_new_entry(self) -> None:
        """A training forward: a window lost to a failure whose step() never came (its
        backward raised) is given up here, without counting a step, as DeepSpeed's counters
        never saw it (the optimizer is back at the step before: its run reopens that step);
        then the last entry, if its backward never came, is settled."""
        self._eval_forward = None  # a backward from here on is this forward's
        if self.window.failed is not None:
            self.window.close()
        self._settle_open_entry()

    def _settle_open_entry(self) -> None:
        """A new forward while the last one's backward never came (a loss logged, say):
        DeepSpeed allows it and drops that forward's graph. Its value may still be read, so an
        unrun one is computed first; nothing of it reaches the gradients."""
        last = self.window.last()
        if last is None or not last.awaits_backward:
            return
        if last.speculative:  # its gradient is in the prefetched run: that run is not the step's
            self._discard_prefetch()
        if last.leaf is not None and not last.leaf.resolved:
            self._forward_alone(last)
        if last.carry is not None:
            self.pipeline.executor.release(last.carry)
            last.carry = None
        last.landed = True

    # --- backward ------------------------------------------------------------------------------
    def backward(
        self, loss: Any, retain_graph: bool = False, scale_wrt_gas: bool = True, **kwargs: Any
    ) -> torch.Tensor:
        """Backward of the last forward's micro-batch. Returns the loss scaled by 1/GAS (as
        DeepSpeed). Whatever the caller did to the loss is honoured: its derivative with respect
        to our loss scales the gradients. At the accumulation boundary the window runs."""
        self.stepper.check()
        entry = self._adopt_eval_forward() or self.window.last()
        if entry is None or not entry.awaits_backward:
            raise RuntimeError("engine.backward() needs a preceding engine.forward() in train mode")
        entry.backward_called = True
        loss_t = getattr(loss, "loss", loss)
        gas = self.gas
        scaled = loss_t / gas if scale_wrt_gas else loss_t
        divide = gas if scale_wrt_gas else None
        if self.batches.seq.returns_outputs:  # d(loss)/d(each output) seeds its backward
            grads = _output_grads(scaled, entry.output_leaves)  # the loss scale: at its run
            assert entry.carry is not None
            entry.resume = Resume(entry.carry, 1.0, grads)
            entry.carry = entry.output_leaves = None  # type: ignore[assignment]
        elif entry.real_leaf is not None:  # its value known at its forward
            entry.factor = _derivative(scaled, entry.real_leaf)
            if entry.carry is not None:  # its forward ran at once (TRL's fused output)
                self._queue_backward(entry)
            else:  # from a prefetched window's run: was its factor the predicted one?
                self._check_prediction(entry)
        else:
            assert entry.leaf is not None
            if entry.carry is None:  # deferred: the derivative without the value, if affine
                entry.factor = derivative(loss_t, entry.leaf, divide_by=divide)
                if entry.factor is None:
                    self._forward_alone(entry)
            if entry.carry is not None:  # its forward ran: the derivative at the value
                entry.factor = derivative(
                    loss_t, entry.leaf, divide_by=divide, at=entry.leaf.value()
                )
                self._queue_backward(entry)
        if self.managed and self.counters.is_boundary():
            self._run_window()
        return scaled.detach()

    # --- the window's runs ------------------------------------------------------------------------
    def _run_window(self) -> None:
        """The boundary: run every queued entry (one schedule) and close the step."""
        if self.window.failed is not None or self.window.closed:
            return  # lost (step() counts it as skipped), or closed by its last run already
        fetched = self.prefetch
        if fetched is not None and fetched.issued:
            self._learn_factors(fetched)
            if fetched.live:
                self._confirm_prefetch(fetched)
                return
        self._run_ready()

    def _run_ready(self) -> None:
        """Run the window's queued work as ONE schedule that closes the step: the resumed
        entries' backwards (first) with the ready entries whole (``Planner.plan(resumed=)``),
        or, with nothing resumed, the ready entries as train_batch's run (in flight when
        iterations overlap)."""
        ready, resumes = self.window.ready(), self.window.resumes()
        if resumes:
            self.pipeline.drain()  # the loss scale of a step in flight's close (fp16), first
            scale = self.host_optimizer.cur_scale
            entries = resumes + ready
            rerun = all(
                e.resume is not None and e.resume.carry.head_input is not None for e in resumes
            )
            self._land(
                self.planner.plan(len(entries), resumed=len(resumes), rerun_head=rerun),
                [e.batch for e in entries], entries, closing=True,
                resumed=0 if rerun else len(resumes),  # (a rerun head reports its loss again)
                resumes=[_scaled(e.resume, scale) for e in resumes if e.resume is not None],
                # the heads that run take the factors: a loss-only read's too
                factors=[e.factor if rerun else 1.0 for e in resumes] + _factors(ready),
            )  # fmt: skip
        elif ready:
            whole = self.window.runs == 0  # the step's only run, as train_batch's
            profile = whole and self.planner.profile_left > 0  # the planner's first steps
            if whole and self.overlap and not profile:
                self._issue_window(ready)
                return
            result = self._land(
                self.planner.plan(len(ready)), [e.batch for e in ready], ready, closing=True,
                factors=_factors(ready), profile=profile,
            )  # fmt: skip
            if whole:  # what the planner learns from a whole step (round size, profile)
                self.pipeline.after_run(result, profile)
        elif self.window.runs:  # every contribution already landed: close
            self._close_now()

    def _land(
        self,
        plan: Any,
        batches: list[Any],
        entries: list[Entry],
        *,
        closing: bool,
        resumed: int = 0,
        **kw: Any,
    ) -> RunResult:
        """One drained run of the open step's work for ``entries`` (the first ``resumed`` of
        them resumed from their forward runs); the others' losses get values."""
        self.pipeline.drain()  # first: a step in flight's close may change the loss scale
        first = entries[min(resumed, len(entries) - 1)]  # the first whose loss the run reports
        try:
            result = self.pipeline.run(
                plan, batches, step=self.counters.global_steps + 1, closes_step=closing,
                grad_scale=self.host_optimizer.cur_scale, microbatch_offset=first.micro_step,
                microbatches=[e.micro_step for e in entries], sole=self.window.runs == 0, **kw,
            )  # fmt: skip
        except BaseException as exc:
            self.window_lost(exc)
            raise
        self._landed(entries, result.losses, closing=closing)
        return result

    def _issue_window(self, ready: list[Entry]) -> None:
        """The whole window as the step's only run, left in flight (iterations overlap, as
        train_batch's): its losses are known when this returns; step() applies the boundary."""
        self.stepper.journal = None  # two open steps from here on, as train_batch's overlap
        try:
            losses = self.pipeline.issue(
                [e.batch for e in ready], unit=1.0, factors=_factors(ready),
                first_microbatch=ready[0].micro_step, microbatches=[e.micro_step for e in ready],
            )  # fmt: skip
        except BaseException as exc:
            self.window_lost(exc)
            raise
        self._landed(ready, losses, closing=True)

    def _landed(self, entries: list[Entry], losses: list[float], *, closing: bool) -> None:
        """A run of the open step landed ``entries``' gradients; their deferred losses get the
        run's values, which are the last entries' (resumed ones report none: they have theirs
        from their forward runs)."""
        self.window.runs += 1
        self.window.closed = closing
        values: list[float | None] = [None] * (len(entries) - len(losses)) + list(losses)
        for entry, value in zip(entries, values, strict=True):
            entry.landed = True
            if value is not None and entry.leaf is not None and not entry.leaf.resolved:
                entry.leaf.set(torch.tensor(value, device=self.device))

    def _close_now(self) -> None:
        """Close a step whose contributions all landed through non-closing runs."""
        step = self.counters.global_steps + 1
        self.stepper.open_step(step)
        self.pipeline.record.last = self.stepper.close_step(step=step, skip=self.guard.force_skip())
        self.pipeline.record.closed()  # its runs' traffic is the step's (last_step_stats)
        self.window.closed = True

    def _skip_lost_step(self) -> None:
        """The open step's window failed: the optimizer declares it skipped (every layer done
        at it, no update), as an fp16 overflow's step, so the next step's buffers are free."""
        step = self.counters.global_steps + 1
        self.stepper.open_step(step)
        self.stepper.close_step(step=step, skip=True)

    def window_lost(self, error: BaseException) -> None:
        """A run of the open step failed: its gradients were dropped (the weights are untouched).
        The window's losses that never got a value raise when read; step() counts the step as
        skipped."""
        self.gate.drop()  # a prefetched window's held gradients are gone with the rest
        self.prefetch = None
        if not self.window.entries:
            return  # train_batch's failure: no window of the loop was open
        for entry in self.window.entries:
            if entry.leaf is not None and not entry.leaf.resolved:
                entry.leaf.fail(error)
            entry.landed = True
            entry.carry = entry.resume = None
        self.window.failed = error

    def resolve_entry(self, entry: Entry) -> None:
        """A deferred loss is read: its forward runs alone, now; its backward stays queued for
        the window's run (``_forward_alone``)."""
        if self.window.failed is not None or entry not in self.window.entries:
            raise RuntimeError(
                "this loss's accumulation window was discarded before it ran (a failed run, or "
                "the engine was destroyed); its value is unknown"
            )
        self._forward_alone(entry)

    # --- a prefetched window (Hugging Face's Trainer) ----------------------------------------------
    def expect_micro_batches(self, batches: list[Any]) -> None:
        """A hint: the next training forwards take these micro-batches, in this order (each a
        dict of keyword arguments, as ``engine(**batch)`` gets it). Their first forward then runs
        the whole window at once, so every forward returns its real loss with no extra run,
        also in loops that read each micro-batch's loss before its backward (Hugging Face's
        Trainer fetches each step's micro-batches up front: ``integrations/hf.py`` passes them
        here). The gradients are checked against each backward (prefetch.py ``Prefetch``); a
        forward with another batch cancels the hint, correct either way."""
        self._cancel_prefetch()
        if self.stepper.dp is not None or self.batches.seq.returns_outputs:
            return  # data parallel reduces per layer as it lands; a module model's outputs
        if self.window.entries:
            return  # mid-window: the hint cannot be the open step's (its forwards began)
        fetched = [self.batch_of((), dict(b)) for b in batches]
        self.prefetch = Prefetch(fetched) if fetched else None

    def window_ahead(self) -> int:
        """How many micro-batches the engine's loader should read and announce now: a whole
        window at a boundary with nothing queued (``data.WindowLoader``), else 0."""
        gas = self.gas
        if not self.managed or self.window.entries or self.counters.micro_steps % gas:
            return 0
        return gas

    def _from_prefetch(self, batch: dict[str, Any], num_items: Any, fused: bool) -> Any:
        """The loss of a forward the prefetched window holds (its run issued at the first), or
        None (no window, or another batch: the hint is cancelled)."""
        fetched = self.prefetch
        if fetched is None:
            return None
        if fetched.done or not _same_batch(fetched, batch, num_items, fused):
            self._cancel_prefetch()
            return None
        if not fetched.issued:
            self._issue_prefetch(fetched, batch, num_items, fused)
        i = fetched.index
        fetched.index += 1
        share = self.batches.token_share(batch, num_items)
        entry = self.window.add(Entry(batch, share, self._next_microbatch(), fused=fused))
        entry.speculative = True
        leaf = torch.tensor(fetched.losses[i], device=self.device, requires_grad=True)
        entry.real_leaf = leaf
        if fused:
            return fused_output(leaf * share, fetched.stats[i], leaf=leaf)
        return self.batches.wrap_loss(leaf * share)

    def _issue_prefetch(
        self, fetched: Prefetch, first: dict[str, Any], num_items: Any, fused: bool
    ) -> None:
        """Run the whole prefetched window now (in flight, as train_batch's), each micro-batch's
        d(loss) scaled by its predicted factor; hold its gradients from the optimizer."""
        fetched.keys, fetched.num_items, fetched.fused = frozenset(first), num_items, fused
        fetched.batches = [{k: b[k] for k in first} for b in fetched.batches]
        fetched.counts = [self.batches.token_count(b) for b in fetched.batches]
        fetched.predicted = self.factor_model.predict(fetched.counts, num_items)
        fetched.step = self.counters.global_steps + 1
        fetched.issued = fetched.live = True
        self.stepper.journal = None  # two open steps, as overlapping train_batch calls
        self.gate.hold(fetched.step)
        first_mb = self._next_microbatch()
        try:
            if self.planner.profile_left > 0:  # the planner's first steps: a run it can time
                fetched.profiled = result = self.pipeline.run(
                    self.planner.plan(len(fetched.batches)), fetched.batches,
                    step=fetched.step, closes_step=False, profile=True, sole=True,
                    grad_scale=self.host_optimizer.cur_scale, factors=fetched.predicted,
                    microbatch_offset=first_mb, token_stats=fused,
                )  # fmt: skip
                fetched.losses = result.losses
                fetched.stats = result.token_stats
            else:
                fetched.losses = self.pipeline.issue(
                    fetched.batches, unit=1.0, factors=fetched.predicted,
                    first_microbatch=first_mb, token_stats=fused,
                    provisional=self._discard_prefetch,
                )  # fmt: skip
        except BaseException as exc:
            self.gate.drop()
            self.prefetch = None
            self.window_lost(exc)
            raise
        if fused and fetched.profiled is None:
            fetched.stats = self.pipeline.token_stats()
        self.window.runs += 1

    def _check_prediction(self, entry: Entry) -> None:
        """A prefetched micro-batch's backward: its factor against the one its run used."""
        fetched = self.prefetch
        assert entry.factor is not None
        if fetched is None or not fetched.live:  # discarded: it runs again at the boundary
            return
        i = fetched.index - 1
        predicted = fetched.predicted[i]
        if not math.isclose(entry.factor, predicted, rel_tol=1e-6, abs_tol=0):
            log.info(
                "prefetched window: micro-batch %d's loss factor %.9g is not the predicted "
                "%.9g; its gradients run again at the boundary", i, entry.factor, predicted,
            )  # fmt: skip
            self._discard_prefetch()

    def _learn_factors(self, fetched: Prefetch) -> None:
        """The next prefetched window's prediction: the model this one's factors followed."""
        entries = [e for e in self.window.entries if e.backward_called and e.real_leaf is not None]
        if len(entries) != fetched.index:
            return  # not the whole window (a forward without backward...): nothing to learn
        factors = [e.factor for e in entries if e.factor is not None]
        counts = fetched.counts[: len(factors)]
        fitted = FactorModel.fit(factors, counts, fetched.num_items)
        if fitted is not None:
            self.factor_model = fitted

    def _confirm_prefetch(self, fetched: Prefetch) -> None:
        """Every backward of the prefetched window matched: its gradients go to the optimizer
        (its run in flight closes the step; step() applies the boundary)."""
        fetched.live = False
        for entry in self.window.entries:
            entry.landed = True
        if fetched.profiled is not None:  # landed, drained: close the step; the planner learns
            self.gate.release()
            self._close_now()
            self.pipeline.after_run(fetched.profiled, profile=True)
            fetched.profiled = None
            return
        self.pipeline.confirm()  # a drain now closes its step
        self.gate.release()
        self.window.closed = True
        if not self.overlap:  # iterations may not overlap here: finish the run now
            self.pipeline.drain()

    def _discard_prefetch(self) -> None:
        """The prefetched run's gradients are not the step's (a factor mispredicted, or the
        pipeline must be quiet before the boundary): finish it, drop them; the window's
        values stay, and its gradients run again at the boundary."""
        fetched = self.prefetch
        if fetched is None or not fetched.live:
            return
        fetched.live = False
        if fetched.profiled is not None:  # landed, not closing: drop its gradients
            fetched.profiled = None
            self.stepper.store.zero_grads()
        else:
            self.pipeline.discard(fetched.step)
        self.gate.drop()
        self.window.runs = 0
        for entry in self.window.entries:
            entry.speculative = False  # ready once its backward came: runs at the boundary

    def _cancel_prefetch(self) -> None:
        """Forget the hint (its unread values are dropped; their forwards will run again)."""
        if self.prefetch is not None:
            self._discard_prefetch()
            self.prefetch = None

    # --- step -----------------------------------------------------------------------------------
    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Called after every micro-batch; applies the optimizer at the accumulation boundary
        (with ``managed_gradient_accumulation: false``, at every call)."""
        self.stepper.check()
        if not (self.counters.is_boundary() or not self.managed):
            self.counters.step(applied=None)
            self.guard.raise_failed()
            return
        self._settle_open_entry()  # a forward whose backward never came adds no gradient
        backwards = sum(1 for e in self.window.entries if e.backward_called)
        if self.window.failed is None:
            self._run_window()
        failed = self.window.failed is not None
        self.window.close()
        if self.prefetch is not None and (self.prefetch.done or failed):
            self.prefetch = None
        if failed:  # its gradients are gone: skipped (no scheduler step, no scale change)
            self._skip_lost_step()
            applied = False
        elif self.pipeline.uncounted_in_flight():
            applied = self.pipeline.apply_in_flight(lr_kwargs)
        else:
            applied = self.pipeline.boundary.apply(lr_kwargs, self.pipeline.record.last)
        if self.managed:
            self.counters.step(applied=applied)
        else:
            self.counters.unmanaged_step(applied=applied, micro_batches=backwards)
        self.guard.raise_failed()  # after the counters: the engine is consistent when it raises

    def discard_window(self) -> None:
        """destroy(): queued work that no boundary will run is dropped (as DeepSpeed drops
        gradients accumulated without a step); its unread losses raise when read."""
        for entry in self.window.entries:
            carry = entry.resume.carry if entry.resume is not None else entry.carry
            if carry is not None and not entry.landed:
                self.pipeline.executor.release(carry)
            if entry.leaf is not None and not entry.leaf.resolved:
                entry.leaf.fail(
                    RuntimeError("the engine was destroyed before this loss's window ran")
                )
        self.window.close()


class LoopMisuseError(RuntimeError, AssertionError):
    """Misuse of the loop that DeepSpeed asserts against (``step()`` inside ``no_sync()``...):
    code written against DeepSpeed that catches AssertionError keeps working."""


def _placeholder(device: torch.device) -> torch.Tensor:
    """A deferred loss's metadata: fp32 0-dim on the engine's device, requiring grad."""
    return torch.full((), float("nan"), device=device).requires_grad_(True)


def _resolver(loop: WindowRunner, entry: Entry) -> Any:
    """The leaf's resolver, holding the loop weakly: a loss kept by the caller must not keep
    the engine (its threads, its memory) alive."""
    ref = weakref.ref(loop)

    def resolve_entry() -> None:
        runner = ref()
        if runner is None:
            raise RuntimeError("the engine was collected before this loss's window ran")
        runner.resolve_entry(entry)

    return resolve_entry


def _fused_request(flag: Any, head: Any) -> bool:
    """Whether the caller asked for TRL's fused-LM-head output; an error if the head can't."""
    if flag and not getattr(head, "token_stats", False):
        raise NotImplementedError(
            f"fused_lm_head=True needs per-token statistics from the model's head, which "
            f"{type(head).__name__} does not compute (only Hugging Face causal LMs' "
            "CausalLMHead does); call the engine without fused_lm_head"
        )
    return bool(flag)


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _output_grads(scaled: Any, leaves: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """d(scaled)/d(each output leaf of a forward), on the host (the backward run uploads
    them); outputs the loss does not depend on get none (nothing flows back)."""
    if not isinstance(scaled, torch.Tensor) or not scaled.requires_grad or not leaves:
        return {}
    keys = list(leaves)
    grads = torch.autograd.grad(scaled, [leaves[k] for k in keys], allow_unused=True)
    return {k: g.detach().cpu() for k, g in zip(keys, grads, strict=True) if g is not None}


def _scaled(resume: Resume, scale: float) -> Resume:
    """A queued backward with the loss scale its run is issued with: on the carried head
    gradients' factor, or on a module model's output gradients."""
    grads = resume.output_grads
    if grads is None:
        return Resume(resume.carry, resume.head_factor * scale)
    return Resume(resume.carry, resume.head_factor, {k: g * scale for k, g in grads.items()})


def _factors(entries: list[Entry]) -> list[float]:
    """The ready entries' factors (every ready entry has one)."""
    return [e.factor for e in entries if e.factor is not None]


def _derivative(scaled: Any, leaf: torch.Tensor) -> float:
    """d(scaled)/d(leaf) through autograd; 0 when the caller's loss does not depend on ours."""
    if not isinstance(scaled, torch.Tensor) or not scaled.requires_grad:
        return 0.0
    (grad,) = torch.autograd.grad(scaled, leaf, allow_unused=True)
    return 0.0 if grad is None else float(grad)


def _same_batch(fetched: Prefetch, batch: dict[str, Any], num_items: Any, fused: bool) -> bool:
    """Whether a forward's micro-batch is the prefetched window's next one: the same tensors
    (the same objects, or equal), and, once its run is issued, the same keys, token count and
    fused-head request as the first forward's."""
    want = fetched.batches[fetched.index]
    if fetched.issued:
        if (frozenset(batch), num_items, fused) != (fetched.keys, fetched.num_items, fetched.fused):
            return False
    elif not set(batch) <= set(want):
        return False
    return all(_same_tensor(want[k], v) for k, v in batch.items())


def _same_tensor(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return bool(a == b)
    if (a.shape, a.dtype) != (b.shape, b.dtype):
        return False
    if a.device != b.device:  # the caller moved its batch to the device (a CUDA loop)
        return bool(torch.equal(a.to(b.device), b))
    if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True
    return bool(torch.equal(a, b))
