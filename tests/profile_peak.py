"""The most bytes the CPU allocator held at once while a call ran: how the planner's predictions are checked
against real steps (tests/planning/test_fit_probe.py, tests/tasks/test_vision_data.py)."""
from torch.profiler import ProfilerActivity, profile


def peak_allocated(fn) -> tuple[object, int]:
    """fn's result, and the most bytes the CPU allocator held at once while it ran, above what it held before:
    the profiler's record of every allocation and free (each op's own, and frees between ops), summed in the
    order they ran (a temporary an op frees before it returns is not seen)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    held = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        held += e.self_cpu_memory_usage
        peak = max(peak, held)
    return result, peak
