"""The checkpoint interval hpctrain chooses (checkpoint.auto_interval): the pure rules of
hpctrain.checkpoint.interval, save_reason's "auto", and the [checkpoint] validation."""
import math

import pytest

from hpctrain.checkpoint import policy
from hpctrain.checkpoint.interval import BUDGET_AIM, PROBE_STEPS, AutoInterval, young_daly_seconds
from hpctrain.config import load_config, validate
from hpctrain.errors import ConfigError


def measured(auto, step=0.02, save=0.3, steps=PROBE_STEPS):
    for _ in range(steps):
        auto.observe_step(step)
    if save is not None:
        auto.observe_save(save)
    return auto


def test_first_save_comes_after_the_probe_steps_to_measure_its_cost():
    auto = AutoInterval(max_overhead=0.02)
    for n in range(1, PROBE_STEPS):
        auto.observe_step(0.02)
        assert not auto.due(n)
    auto.observe_step(0.02)
    assert auto.due(PROBE_STEPS) and auto.steps is None


def test_budget_interval_keeps_the_overhead_under_the_budget():
    for budget, cost, step in [(0.02, 1.2, 0.05), (0.1, 0.3, 0.02), (0.01, 5.0, 0.4), (0.2, 0.001, 0.5)]:
        auto = measured(AutoInterval(max_overhead=budget), step, cost)
        assert auto.due(0) is False or auto.steps == 1
        n = auto.steps
        assert n == max(1, math.ceil(cost / (BUDGET_AIM * budget * step)))
        assert cost / (n * step + cost) <= budget  # the fraction of wall time spent waiting
        if n > 1:  # and it is the most frequent interval that does
            assert cost / ((n - 1) * step) > BUDGET_AIM * budget
        assert auto.why == "budget"


def test_young_daly_interval_is_sqrt_2_c_mtbf():
    auto = measured(AutoInterval(mtbf_hours=24), step=0.05, save=1.2)
    auto.due(0)
    tau = math.sqrt(2 * 1.2 * 24 * 3600)
    assert young_daly_seconds(1.2, 24 * 3600) == pytest.approx(tau)
    assert auto.steps == round(tau / 0.05) and auto.why == "mtbf"
    assert "Young/Daly" in auto.describe(1.2, 0.05)


def test_with_both_rules_the_more_frequent_wins():
    # Young/Daly wants sqrt(2 x 1 x 3600) = 85 s = 849 steps; a 10% budget allows every 125 steps
    auto = measured(AutoInterval(max_overhead=0.1, mtbf_hours=1), step=0.1, save=1.0)
    auto.due(0)
    assert (auto.steps, auto.why) == (125, "budget")
    # frequent failures: Young/Daly (sqrt(2 x 1 x 36) = 8.5 s = 85 steps) beats a 0.1% budget (12500 steps)
    auto = measured(AutoInterval(max_overhead=0.001, mtbf_hours=0.01), step=0.1, save=1.0)
    auto.due(0)
    assert (auto.steps, auto.why) == (85, "mtbf")


def test_every_steps_and_every_minutes_bound_the_interval():
    auto = measured(AutoInterval(max_overhead=0.01, every_steps=100), step=0.02, save=1.0)
    auto.due(0)
    assert (auto.steps, auto.why) == (100, "every_steps")
    auto = measured(AutoInterval(max_overhead=0.01, every_minutes=0.5), step=0.02, save=1.0)
    auto.due(0)
    assert (auto.steps, auto.why) == (1500, "every_minutes")  # 30 s / 0.02 s


def test_due_after_the_interval_counted_from_the_last_save():
    auto = measured(AutoInterval(max_overhead=0.1), step=0.02, save=0.3)
    n = math.ceil(0.3 / (BUDGET_AIM * 0.1 * 0.02))
    assert not auto.due(n - 1) and auto.due(n) and auto.due(n + 5)


def test_retuned_when_the_costs_drift_and_each_change_logged():
    auto = measured(AutoInterval(max_overhead=0.1), step=0.02, save=0.3)
    auto.due(0)
    first = auto.steps
    assert len(auto.changes) == 1 and f"every {first} steps" in auto.changes[0]
    assert "save blocks 0.3 s" in auto.changes[0] and "step 0.02 s" in auto.changes[0]
    # noise of a few percent: no change
    for cost in (0.31, 0.29, 0.305, 0.3):
        auto.observe_save(cost)
        auto.due(0)
    assert auto.steps == first and len(auto.changes) == 1
    # saves become slower: longer at once (the budget would be broken)
    for _ in range(5):
        auto.observe_save(0.6)
    auto.due(0)
    assert auto.steps > first and len(auto.changes) == 2 and f"was every {first}" in auto.changes[1]
    # steps become 4x slower (the median of the window): shorter, from the next save on
    longer = auto.steps
    for _ in range(64):
        auto.observe_step(0.08)
    auto.due(0)
    assert auto.steps == longer
    auto.observe_save(0.6)
    auto.due(0)
    assert auto.steps < longer / 3 and len(auto.changes) == 3


def test_one_slow_step_does_not_move_the_interval():
    auto = measured(AutoInterval(max_overhead=0.1), step=0.02, save=0.3, steps=20)
    auto.due(0)
    first = auto.steps
    auto.observe_step(5.0)  # a stall: the median does not see it
    auto.observe_save(0.3)
    auto.due(0)
    assert auto.steps == first


def test_a_save_before_any_timed_step_does_not_stop_the_tuning():
    auto = AutoInterval(max_overhead=0.1)
    auto.observe_save(0.3)  # e.g. a save requested at the first step
    assert not auto.due(0) and auto.steps is None
    measured(auto, step=0.02, save=None)
    assert auto.due(10_000) and auto.steps == 188


def test_needs_a_rule():
    with pytest.raises(ValueError):
        AutoInterval()


def test_save_reason_auto_after_the_explicit_ones():
    assert policy.save_reason(10, 5, 1.0, auto_due=True) == "auto"
    assert policy.save_reason(10, 5, 1.0, auto_due=False) is None
    assert policy.save_reason(10, 10, 1.0, auto_due=True) is None  # never twice for one step
    assert policy.save_reason(10, 5, 1.0, final=True, auto_due=True) == "final"
    assert policy.save_reason(10, 5, 120.0, every_minutes=1, auto_due=True) == "time"


def checked(*overrides):
    return validate(load_config(None, ["data.path=x.h5", *overrides], environ={}))


def test_config_auto_interval_fields():
    k = checked("checkpoint.auto_interval=true", "checkpoint.max_overhead=0.02", "checkpoint.mtbf_hours=24").checkpoint
    assert k.auto_interval is True and k.max_overhead == 0.02 and k.mtbf_hours == 24.0


@pytest.mark.parametrize("overrides, words", [
    (["checkpoint.auto_interval=true"], ["neither checkpoint.max_overhead nor checkpoint.mtbf_hours",
                                         "checkpoint.max_overhead=0.02"]),
    (["checkpoint.max_overhead=0.02"], ["checkpoint.max_overhead = 0.02", "auto_interval=true"]),
    (["checkpoint.mtbf_hours=24"], ["checkpoint.mtbf_hours = 24.0", "auto_interval=true"]),
    (["checkpoint.auto_interval=true", "checkpoint.max_overhead=2"], ["max_overhead = 2.0", "below 0.5",
                                                                      "0.02 for 2%"]),
    (["checkpoint.auto_interval=true", "checkpoint.max_overhead=-0.1"], ["max_overhead = -0.1", ">= 0"]),
    (["checkpoint.auto_interval=true", "checkpoint.mtbf_hours=-1"], ["mtbf_hours = -1.0", ">= 0"]),
    (["checkpoint.auto_interval=true", "checkpoint.mtbf_hours=nan"], ["mtbf_hours = nan", "finite"]),
    (["checkpoint.auto_interval=true", "checkpoint.max_overhead=inf"], ["max_overhead = inf", "finite"]),
])
def test_config_auto_interval_errors_name_field_value_and_fix(overrides, words):
    with pytest.raises(ConfigError) as info:
        checked(*overrides)
    text = str(info.value)
    assert "HINT:" in text
    for word in words:
        assert word in text, text


def test_async_interval_at_least_the_background_write():
    # an async save blocks 10 ms: the budget alone would save every 7 steps (0.14 s), but the
    # background write takes 1 s, and a save started before it ends would wait for it
    auto = measured(AutoInterval(max_overhead=0.1), step=0.02, save=0.01)
    auto.due(0)
    assert (auto.steps, auto.why) == (7, "budget")
    auto.observe_write(1.0)
    auto.due(0)
    assert (auto.steps, auto.why) == (50, "async_write") and "background write 1 s" in auto.changes[-1]


def test_no_save_is_due_while_a_background_write_is_in_flight():
    # the interval is over, but the last write is not durable yet: a save started now would block
    # training until it is, for an older step than the first one after it
    auto = measured(AutoInterval(max_overhead=0.1), step=0.02, save=0.01)
    auto.call_ended(1.0, 10)
    assert not auto.due_at(40, 1.6, last_saved_step=10, writing=True)
    assert auto.due_at(41, 1.62, last_saved_step=10, written=0.5)
    assert auto.write_time == 0.5  # what the write took was taken in once durable


def test_interval_model_of_docs_performance():
    """benchmarks/interval_model.py (the table of docs/performance.md): deterministic, the
    auto interval is Young's, and under its assumptions it finishes no later than a fixed one."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "interval_model.py"
    spec = importlib.util.spec_from_file_location("interval_model", path)
    model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model)
    assert model.table() == model.table()
    rows = model.rows()
    for nodes in model.NODES:
        mine = {r["strategy"]: r for r in rows if r["nodes"] == nodes}
        mtbf = model.ASSUMPTIONS["node_mtbf_years"] * model.YEAR / nodes
        auto = mine["auto (mtbf_hours), sync, supervisor"]
        assert auto["interval_min"] * 60 == pytest.approx(math.sqrt(2 * 60.0 * mtbf))
        assert auto["wall_days"] <= mine["fixed 1 h, sync, supervisor"]["wall_days"]
        fixed = mine["fixed 1 h, sync, supervisor"]["wall_days"]
        assert fixed < mine["fixed 1 h, sync, manual resubmission"]["wall_days"]
    # with no failures and no saves the model gives the work itself
    assert model.completion(3600.0, 3600.0, 0.0, 1e12, 0.0) == pytest.approx(3600.0)
