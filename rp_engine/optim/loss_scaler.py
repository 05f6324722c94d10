"""fp16 loss scaling with DeepSpeed's semantics (static, or dynamic with hysteresis).

The state machine mirrors ``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler`` exactly (the
test suite checks the two against each other) but has no dependency on torch.distributed, so it
works in a single process with no launcher.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LossScaler"]


@dataclass
class LossScaler:
    """Loss scale for fp16; ``dynamic=False`` keeps ``cur_scale`` fixed (1.0 for bf16/fp32)."""

    cur_scale: float = 1.0
    dynamic: bool = False
    scale_window: int = 1000
    min_scale: float = 1.0
    delayed_shift: int = 2
    consecutive_hysteresis: bool = False
    cur_iter: int = 0
    last_overflow_iter: int = -1
    cur_hysteresis: int = 2

    @classmethod
    def from_fp16(
        cls,
        *,
        enabled: bool,
        loss_scale: float,
        initial_scale_power: int,
        loss_scale_window: int,
        hysteresis: int,
        consecutive_hysteresis: bool,
        min_loss_scale: float,
    ) -> LossScaler:
        if not enabled:
            return cls()
        if loss_scale != 0:  # DeepSpeed: a nonzero loss_scale means static scaling
            return cls(cur_scale=float(loss_scale))
        return cls(
            cur_scale=float(2**initial_scale_power),
            dynamic=True,
            scale_window=loss_scale_window,
            min_scale=float(min_loss_scale),
            delayed_shift=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis,
            cur_hysteresis=hysteresis,
        )

    def update(self, overflow: bool) -> None:
        """Advance one boundary step. Raises when an overflow happens at the minimum scale."""
        if not self.dynamic:
            return
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale:
                    raise FloatingPointError(
                        "fp16 loss scale is already at fp16.min_loss_scale and gradients still "
                        "overflow; lower the learning rate or use bf16"
                    )
                self.cur_scale = max(self.cur_scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= 2.0
        self.cur_iter += 1

    def state_dict(self) -> dict[str, float | int | bool]:
        return dict(vars(self))

    def load_state_dict(self, state: dict[str, float | int | bool]) -> None:
        for key, value in state.items():
            setattr(self, key, value)
