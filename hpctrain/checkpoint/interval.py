"""The checkpoint interval hpctrain chooses (``checkpoint.auto_interval``): pure arithmetic on times the
manager measures; no MPI, no clock of its own. Two rules, each optional, both from the save cost C (the
seconds a save *blocks* training: a synchronous save's whole write, an asynchronous one's snapshot plus any
wait for the previous write) and the step time T (seconds between saves' ends and the next call, per step,
saves excluded):

* overhead budget ``max_overhead`` = b: save every N = ceil(C / (0.8 b T)) steps, so that C / (N T) stays
  under b while the estimates drift by up to 1.25 (see below);
* failure rate ``mtbf_hours`` = M (Young/Daly): the interval that minimises expected save cost plus lost work,
  sqrt(2 C M) seconds, N = round(sqrt(2 C M) / T) steps.

With both, the more frequent wins: the budget says what saving may cost, Young/Daly when saving less often
would lose more work to failures than it saves in cost. With ``async_save`` the interval is at least as long
as a background write takes (W, measured too): a save that starts earlier waits for the previous one, and that
wait is cost. While a background write is still in flight no save is due: started then, it would block
training until the write ends and hold an older step than one started after it. ``every_steps`` and
``every_minutes``, when also set, are upper bounds on the interval.

C is the mean of the last few saves (a budget pays the slow ones too), T the median of the last steps. After
each save (when C has a new sample) the interval is re-tuned if the one the estimates call for is longer than
the current by more than 1 / :data:`BUDGET_AIM` (the budget would be broken) or shorter by more than
:data:`SHORTER_FACTOR`; smaller changes are noise, and each change is logged.

>>> auto = AutoInterval(max_overhead=0.1)
>>> for _ in range(PROBE_STEPS):
...     auto.observe_step(0.02)
>>> auto.due(steps_since_save=5)      # no save measured yet: the first one is due now
True
>>> auto.observe_save(0.3)
>>> auto.due(steps_since_save=1), auto.steps   # ceil(0.3 / (0.8 x 0.1 x 0.02)) = 188
(False, 188)
"""
import math
import statistics
from collections import deque

PROBE_STEPS = 5  # steps timed before the first save, which measures the save cost
STEP_WINDOW = 64  # recent step times whose median is T
SAVE_WINDOW = 5  # recent save costs whose mean is C
BUDGET_AIM = 0.8  # of max_overhead: it is a maximum, and the estimates drift between re-tunings
SHORTER_FACTOR = 1.5  # re-tune when the wanted interval is this much shorter than the current


class AutoInterval:
    """Rank 0's estimates and interval (``steps``: None until a save is measured). Feed it
    :meth:`observe_step` (per step) and :meth:`observe_save` (seconds a save blocked), ask :meth:`due`;
    :attr:`changes` collects the log line of each change. ``every_steps``/``every_minutes``: 0 for none."""

    def __init__(self, max_overhead=0.0, mtbf_hours=0.0, every_steps=0, every_minutes=0.0):
        if max_overhead <= 0 and mtbf_hours <= 0:
            raise ValueError("AutoInterval needs max_overhead > 0 or mtbf_hours > 0")
        self.max_overhead, self.mtbf_seconds = max_overhead, mtbf_hours * 3600.0
        self.every_steps, self.every_seconds = every_steps, every_minutes * 60.0
        self._steps = deque(maxlen=STEP_WINDOW)
        self._saves, self._writes = deque(maxlen=SAVE_WINDOW), deque(maxlen=SAVE_WINDOW)
        self.steps = self.why = None
        self._tuned = True  # the interval fits the latest save cost
        self.changes = []
        # What the manager measured at its calls: (clock, step) at the end of the previous one,
        # what the last save cost the training (fed at the next call), the step it started from.
        self._mark = self._blocked = self._first_step = None

    # -- measurements

    def observe_step(self, seconds, count=1):
        """``count`` steps took ``seconds`` together (saves excluded)."""
        if count > 0 and seconds >= 0:
            self._steps.extend([seconds / count] * min(count, STEP_WINDOW))

    def observe_save(self, seconds):
        """A save blocked training for ``seconds``."""
        if seconds >= 0:
            self._saves.append(seconds)
        self._tuned = False

    def observe_write(self, seconds):
        """A background (``async_save``) write took ``seconds`` from start to durable."""
        if seconds >= 0:
            self._writes.append(seconds)
            self._tuned = False

    @property
    def write_time(self):
        return statistics.fmean(self._writes) if self._writes else None

    @property
    def save_cost(self):
        return statistics.fmean(self._saves) if self._saves else None

    @property
    def step_time(self):
        return statistics.median(self._steps) if self._steps else None

    def call_ended(self, when, step, blocked=None):
        """The manager's call at ``step`` returned at ``when``; ``blocked``: the seconds its save took."""
        if blocked is not None:
            self._blocked = blocked
        self._mark = (when, step)

    def due_at(self, step, now, last_saved_step, written=None, writing=False):
        """Rank 0 at the manager's call at ``step``: feed what was measured since the last call
        (``written``: a background write's seconds, once durable); is a save due? Not while ``writing``
        (a background write is in flight)."""
        if self._blocked is not None:
            self.observe_save(self._blocked)
            self._blocked = None
        if written is not None:
            self.observe_write(written)
        if self._mark is not None and step > self._mark[1]:  # not a second call at one step, nor a rollback
            self.observe_step(now - self._mark[0], step - self._mark[1])
        if self._first_step is None:
            self._first_step = step
        return not writing and self.due(step - (last_saved_step if last_saved_step is not None else self._first_step))

    # -- the rules

    def wanted(self, save_cost, step_time):
        """(steps, why) for these estimates: the interval and the rule that set it."""
        step_time = max(step_time, 1e-9)
        rules = []
        if self.max_overhead > 0:
            rules.append((math.ceil(save_cost / (BUDGET_AIM * self.max_overhead * step_time)), "budget"))
        if self.mtbf_seconds > 0:
            rules.append((round(young_daly_seconds(save_cost, self.mtbf_seconds) / step_time), "mtbf"))
        steps, why = min(rules)  # the more frequent; on a tie the budget
        write = self.write_time
        if write is not None and write > steps * step_time:  # lower bound: no save waits for the last
            steps, why = math.ceil(write / step_time), "async_write"
        if self.every_steps > 0 and self.every_steps < steps:  # upper bounds
            steps, why = self.every_steps, "every_steps"
        if self.every_seconds > 0 and self.every_seconds / step_time < steps:
            steps, why = math.floor(self.every_seconds / step_time), "every_minutes"
        return max(1, steps), why

    def due(self, steps_since_save):
        """Is a save due, ``steps_since_save`` steps after the last one (or since this
        process started, when it has not saved)? Re-tunes first."""
        if self.save_cost is None:
            return len(self._steps) >= PROBE_STEPS
        if not self._tuned:
            self._tuned = self._retune()
        return self.steps is not None and steps_since_save >= self.steps

    def _retune(self):
        """Choose the interval again if it has moved enough; False while no step is timed."""
        cost, step = self.save_cost, self.step_time
        if step is None:
            return False
        steps, why = self.wanted(cost, step)
        # Small changes are noise: the budget aims low enough to absorb them.
        if self.steps is not None and self.steps / SHORTER_FACTOR <= steps <= self.steps / BUDGET_AIM:
            return True
        before, self.steps, self.why = self.steps, steps, why
        self.changes.append(self.describe(cost, step, before))
        return True

    def describe(self, cost, step, before=None):
        """The log line of the current interval."""
        parts = [f"save blocks {cost:.3g} s", f"step {step:.3g} s"]
        if self.write_time is not None:
            parts.append(f"background write {self.write_time:.3g} s")
        if self.max_overhead > 0:
            parts.append(f"budget {self.max_overhead:.3g} of wall time -> "
                         f"{100 * (cost / (self.steps * step + cost)):.2g}% spent")
        if self.mtbf_seconds > 0:
            parts.append(f"MTBF {self.mtbf_seconds / 3600:.3g} h -> Young/Daly "
                         f"{young_daly_seconds(cost, self.mtbf_seconds):.3g} s")
        rule = {"budget": "the overhead budget", "mtbf": "Young/Daly for the MTBF",
                "every_steps": "checkpoint.every_steps",
                "async_write": "the background write's duration", "every_minutes": "checkpoint.every_minutes"}[self.why]
        was = "" if before is None else f", was every {before}"
        return (f"checkpoint interval: every {self.steps} steps, ~{self.steps * step:.3g} s "
                f"({', '.join(parts)}; set by {rule}{was})")


def young_daly_seconds(save_cost, mtbf_seconds):
    """Young's first-order optimum interval between checkpoints: sqrt(2 C M)."""
    return math.sqrt(2.0 * save_cost * mtbf_seconds)
