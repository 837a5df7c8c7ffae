"""The thread governor follows the cores a process could use, only after two readings agree."""

from __future__ import annotations

from tideserve.engine.threads import CpuSample, ThreadGovernor, read_cpu_sample


class FakeCpu:
    """Each reading advances 2 s of wall time with the given idle cores and own CPU use."""

    def __init__(self) -> None:
        self.sample = CpuSample(0.0, 0.0, 0.0)
        self.idle_cores = 0.0
        self.own_cores = 2.0

    def __call__(self) -> CpuSample:
        s = self.sample
        self.sample = CpuSample(s.wall_s + 2.0, s.idle_s + 2.0 * self.idle_cores, s.own_s + 2.0 * self.own_cores)
        return self.sample


def governor(cpu: FakeCpu) -> tuple[ThreadGovernor, list[int]]:
    calls: list[int] = []
    return ThreadGovernor(max_threads=2, interval_s=0.0, sampler=cpu, set_threads=calls.append), calls


def test_a_busy_neighbour_drops_a_thread_and_its_leaving_restores_it():
    cpu = FakeCpu()
    gov, calls = governor(cpu)
    assert [gov.observe() for _ in range(3)] == [2, 2, 2]  # quiet: we use both cores
    cpu.own_cores = 1.0  # a neighbour took one core: our two threads together get one
    assert gov.observe() == 2  # one reading is not enough
    assert gov.observe() == 1
    assert calls == [1]
    cpu.own_cores, cpu.idle_cores = 1.0, 1.0  # the neighbour left: a core sits idle
    assert [gov.observe(), gov.observe()] == [1, 2]
    assert calls == [1, 2] and gov.num_changes == 2


def test_a_single_burst_does_not_flap():
    cpu = FakeCpu()
    gov, calls = governor(cpu)
    gov.observe()
    cpu.own_cores = 1.0
    gov.observe()
    cpu.own_cores = 2.0
    assert [gov.observe() for _ in range(3)] == [2, 2, 2]
    assert calls == []


def test_one_thread_is_never_changed_and_this_machine_can_be_read():
    cpu = FakeCpu()
    gov = ThreadGovernor(max_threads=1, interval_s=0.0, sampler=cpu, set_threads=lambda n: None)
    cpu.own_cores = 0.2
    assert [gov.observe() for _ in range(4)] == [1, 1, 1, 1]
    sample = read_cpu_sample()
    assert sample is None or (sample.idle_s >= 0 and sample.own_s > 0)


def test_the_machine_is_read_once_per_interval_not_once_per_step():
    cpu = FakeCpu()
    reads = []
    clock = [0.0]
    gov = ThreadGovernor(max_threads=2, interval_s=2.0, sampler=lambda: reads.append(1) or cpu(),
                         set_threads=lambda n: None, clock=lambda: clock[0])
    for _ in range(10):  # ten steps within one interval
        gov.observe()
        clock[0] += 0.1
    assert len(reads) == 1
    clock[0] += 2.0
    gov.observe()
    assert len(reads) == 2
